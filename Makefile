# fedhm-flwr: `make run` sets everything up and runs the default job; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: setup data run test test-fast inspect clean-outputs

setup: $(STAMP)  ## virtualenv with the project and its pinned torch/torchvision pair

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(BIN)/python -m pip install -e ".[test]"
	@rm -f $(VENV)/.installed-*
	touch $@

data:  ## Fashion-MNIST from Debian's package, unless FEDHM_DATA_DIR points at a copy
	@if [ -n "$$FEDHM_DATA_DIR" ] || [ -f $(FASHION_MNIST) ]; then exit 0; fi; \
	echo "Installing Debian's dataset-fashion-mnist"; \
	if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist; fi

run: setup data  ## the default job (FedHM, Fashion-MNIST, CNN, 4 levels) through `flwr run`; ARGS= Hydra overrides
	$(BIN)/python -m fedhm_flwr.launch $(ARGS)

test: setup data  ## every test, the slow end-to-end ones included
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: setup data  ## the tests without the slow end-to-end runs
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

inspect: setup  ## per-level parameters / MACs / bytes; ARGS= Hydra overrides
	$(BIN)/python -m fedhm_flwr.inspect $(ARGS)
