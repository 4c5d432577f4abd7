"""The studies of ``make results``: settings, methods, seeds, transports, where the finished runs
live and which are missing, in the order they run (how long they should take: :mod:`bench.estimates`).

No run is started here (:mod:`bench.results` runs them; :mod:`bench.results_page` tabulates them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results"
PAGE = ROOT / "docs" / "RESULTS.md"
FIGURES = ROOT / "docs" / "results"

#: the work every run of the cheap study shares (Hydra overrides of conf/config.yaml)
COMMON = (
    "dataset=fashion_mnist model=cnn levels.ratios=[1,0.5,0.25,0.125] num_clients=20 fraction_train=0.5 "
    "rounds=30 train.lr_schedule=cosine levels.match=fedhm_params "
    "dataset.max_train_examples=6000 dataset.max_test_examples=3000 tracking.tensorboard=false"
)
#: one folder per data setting
ALPHAS = {
    "dir0.5": "partition.scheme=dirichlet partition.alpha=0.5",
    "dir0.1": "partition.scheme=dirichlet partition.alpha=0.1",
}
#: the methods compared: name -> overrides
VARIANTS = {
    "fedhm": "method=fedhm",
    "heterofl": "method=heterofl",
    "fedrolex": "method=fedrolex",
    "fedavg": "method=fedavg",
    "fedavg_smallest": "method=fedavg_smallest",
    "fedhm_distill": "method=fedhm train.distill.enabled=true",
    "heterofl_memory": "method=heterofl levels.match=fedhm_memory",
    "fedrolex_memory": "method=fedrolex levels.match=fedhm_memory",
    "fjord": "method=fjord",
    "fiarse": "method=fiarse",
}
#: a variant no other study has run stands in for by the one it differs from in its widths only, or
#: (FIARSE: every client trains the full-shape model, masked) by the one whose clients train the same model
STAND_IN = {"heterofl_memory": "heterofl", "fedrolex_memory": "fedrolex", "fjord": "heterofl", "fiarse": "fedavg"}
#: the methods of the first two studies (they predate the memory-matched ones)
FIRST_VARIANTS = ("fedhm", "heterofl", "fedrolex", "fedavg", "fedavg_smallest", "fedhm_distill")
LABELS = {
    "fedhm": "FedHM",
    "heterofl": "HeteroFL (matched)",
    "fedrolex": "FedRolex (matched)",
    "heterofl_memory": "HeteroFL (memory-matched)",
    "fedrolex_memory": "FedRolex (memory-matched)",
    "fjord": "FjORD (matched)",
    "fiarse": "FIARSE (parameter-matched)",
    "fedavg": "FedAvg, full model",
    "fedavg_smallest": "FedAvg, smallest FedHM model",
    "fedhm_distill": "FedHM + self-distillation",
}
TITLES = {"dir0.5": "Dirichlet α = 0.5", "dir0.1": "Dirichlet α = 0.1 (strongly non-IID)"}
#: files of a run that are kept (the rest: checkpoints, plots, event files)
KEEP = ("config.yaml", "metrics.jsonl", "summary.json")
#: how a run's messages travel: ``summary.json``'s ``transport`` (runs without one used the grid)
TRANSPORTS = {
    "grid": "in-process grid (`fedhm_flwr/ops/apps/local_grid.py`)",
    "ray": "`flwr run` on Flower's Ray simulation engine (`fedhm_flwr/ops/job/launch.py`)",
}


@dataclass(frozen=True)
class Study:
    """One comparison: its runs live in ``<runs>/<folder>/<setting>/<variant>/seed<k>``."""

    key: str
    title: str
    folder: str  # "" for the cheap study (its runs predate the second one)
    common: str
    seeds: tuple[int, ...]
    ray_seeds: tuple[int, ...] = ()  # seeds run through ``flwr run`` on Ray (the others: in-process grid)
    settings: tuple[str, ...] = tuple(ALPHAS)
    variants: tuple[str, ...] = FIRST_VARIANTS
    work: str = ""  # the page's sentence on the data, model and schedule
    #: per setting, the seeds it runs when not all of ``seeds`` (setting -> seeds)
    setting_seeds: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: (setting, seeds) run first, every variant, seed by seed (the rest follows in the usual order)
    lead: tuple[str, tuple[int, ...]] | None = None
    #: run by ``make results`` without ``--study`` and shown on the page without runs of its own
    default: bool = True

    def overrides(self, setting: str, variant: str, seed: int) -> str:
        return f"{self.common} {ALPHAS[setting]} {VARIANTS[variant]} seed={seed}"

    def transport(self, seed: int) -> str:
        return "ray" if seed in self.ray_seeds else "grid"

    def seeds_of(self, setting: str) -> tuple[int, ...]:
        return dict(self.setting_seeds).get(setting, self.seeds)

    def runs(self) -> list[tuple[str, str, int]]:
        """Every (setting, variant, seed) of the study in the order they run: the ``lead`` first,
        then seed by seed (so that an interrupted run leaves whole seeds behind)."""
        every = [(s, v, k) for k in self.seeds for s in self.settings for v in self.variants if k in self.seeds_of(s)]
        first = [(s, v, k) for s, v, k in every if self.lead and s == self.lead[0] and k in self.lead[1]]
        return first + [r for r in every if r not in first]


#: the second study's work: the probe's chosen candidate (bench/capacity_probe.py, results/probe/)
CAPACITY_COMMON = COMMON.replace("model=cnn", "model=cnn model.width=4")
#: the full study's schedule: 50 rounds of 10 clients (10 passes over the training set in all, the cosine
#: learning rate reaching 0 at the last) and an evaluation every 5th round and after the last: in its probe
#: (``results/full/rounds3/``) one evaluation (the 10,000 test images at every level) cost more than a
#: round's training, so evaluating every round would more than double a run (the page states the estimate)
FULL_ROUNDS, FULL_EVERY = 50, 5
FULL_COMMON = (
    "dataset=fashion_mnist model=cnn levels.ratios=[1,0.5,0.25,0.125] num_clients=50 fraction_train=0.2 "
    f"rounds={FULL_ROUNDS} evaluation.every={FULL_EVERY} train.lr_schedule=cosine levels.match=fedhm_params "
    "tracking.tensorboard=false"
)
FULL_CIFAR_COMMON = FULL_COMMON.replace("dataset=fashion_mnist model=cnn", "dataset=cifar10 model=resnet18")
FULL_VARIANTS = (
    "fedhm",
    "heterofl",
    "fedrolex",
    "heterofl_memory",
    "fedrolex_memory",
    "fedavg",
    "fedavg_smallest",
    "fjord",
    "fiarse",
)
#: the study of real size (#42): its own probe, in results/full/rounds3/, sized its rounds
FULL = Study(
    "full",
    "the full setting (60,000 examples, 50 clients, CNN width 16)",
    "full",
    FULL_COMMON,
    (0, 1, 2, 3, 4),
    settings=("dir0.5", "dir0.1"),
    variants=FULL_VARIANTS,
    work="the whole Fashion-MNIST training set (60,000 examples) split over 50 clients and the whole "
    f"10,000-example test set, the CNN (width 16) at FedHM's levels γ = 1, 1/2, 1/4, 1/8, 10 clients "
    f"sampled per round, 1 local epoch, {FULL_ROUNDS} rounds with a cosine learning rate, evaluated every "
    f"{FULL_EVERY} rounds and after the last; HeteroFL and FedRolex matched to FedHM's parameters and, "
    "separately, to its training memory per level",
    setting_seeds=(("dir0.1", (0, 1, 2)),),
    lead=("dir0.5", (0, 1, 2)),
)


STUDIES = {
    "cheap": Study(
        "cheap",
        "the cheap setting (6,000 examples, CNN width 16)",
        "",
        COMMON,
        (0, 1, 2),
        work="Fashion-MNIST (a seeded 6,000-example training subset split over 20 clients, a seeded "
        "3,000-example test subset), the CNN (width 16) at FedHM's levels γ = 1, 1/2, 1/4, 1/8 (a fixed "
        "level per client, equal shares), 10 clients sampled per round, 1 local epoch, 30 rounds with a "
        "cosine learning rate",
    ),
    "capacity": Study(
        "capacity",
        "the capacity setting (6,000 examples, CNN width 4)",
        "capacity",
        CAPACITY_COMMON,
        (0, 1, 2, 3, 4),
        ray_seeds=(4,),
        work="as the cheap setting but the CNN at width 4 (hidden sizes 4, 8, 16, 32), where the smallest "
        'level\'s model holds too little of what the data can teach (see "Why this setting")',
    ),
    "full": FULL,
    "full_cifar10": dataclasses.replace(
        FULL,
        key="full_cifar10",
        title="the full setting on CIFAR-10 (50,000 examples, 50 clients, ResNet-18)",
        folder="full_cifar10",
        common=FULL_CIFAR_COMMON,
        work="the full study on CIFAR-10 (the user's copy: `--data-dir`), with ResNet-18 (FedHM's CIFAR "
        "model, `model=resnet18`) instead of the CNN",
        default=False,
    ),
}


def run_dir(study: Study, setting: str, variant: str, seed: int, root: Path = RUNS) -> Path:
    return root / study.folder / setting / variant / f"seed{seed}"


def finished(path: Path) -> bool:
    return all((path / name).is_file() for name in KEEP)


class Job(NamedTuple):
    study: str
    setting: str
    variant: str
    seed: int
    overrides: str
    dest: str
    transport: str


def studies_with_seeds(keys: list[str] | None = None, seeds: tuple[int, ...] | None = None) -> list[Study]:
    """The studies named (``None``: the default ones), with their seeds replaced by ``seeds`` when given."""
    chosen = [STUDIES[k] for k in (keys if keys is not None else [k for k, s in STUDIES.items() if s.default])]
    return [s if seeds is None else dataclasses.replace(s, seeds=seeds, setting_seeds=()) for s in chosen]


def shortened(study: Study, rounds: int) -> Study:
    """``study`` cut to ``rounds`` rounds and evaluated after every round, its runs kept apart in
    ``<folder>/rounds<N>`` (never counted as the study's own; their seconds per round of training and
    per evaluation estimate the study's runs, :func:`bench.estimates.projected_seconds`)."""
    if rounds < 1:
        raise SystemExit(f"--rounds: {rounds} is not a number of rounds (an integer >= 1)")
    return dataclasses.replace(
        study,
        title=f"{study.title}, shortened to {rounds} round(s)",
        folder=str(Path(study.folder) / f"rounds{rounds}"),
        common=f"{study.common} rounds={rounds} evaluation.every=1",
    )


def missing(root: Path, studies: list[Study]) -> list[Job]:
    # study by study, each in its own order (Study.runs)
    return [
        Job(st.key, s, v, k, st.overrides(s, v, k), str(run_dir(st, s, v, k, root)), st.transport(k))
        for st in studies
        for s, v, k in st.runs()
        if not finished(run_dir(st, s, v, k, root))
    ]
