"""The studies of ``make results`` and their plan: settings, methods, seeds, transports, where the
finished runs live, which are missing and how long they should take (from measured runs).

No run is started here (:mod:`bench.results` runs them; :mod:`bench.results_page` tabulates them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
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
}
LABELS = {
    "fedhm": "FedHM",
    "heterofl": "HeteroFL (matched)",
    "fedrolex": "FedRolex (matched)",
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
    variants: tuple[str, ...] = tuple(VARIANTS)
    work: str = ""  # the page's sentence on the data, model and schedule

    def overrides(self, setting: str, variant: str, seed: int) -> str:
        return f"{self.common} {ALPHAS[setting]} {VARIANTS[variant]} seed={seed}"

    def transport(self, seed: int) -> str:
        return "ray" if seed in self.ray_seeds else "grid"


#: the second study's work: the probe's chosen candidate (bench/capacity_probe.py, results/probe/)
CAPACITY_COMMON = COMMON.replace("model=cnn", "model=cnn model.width=4")
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
    """The studies named (all by default), with their seeds replaced by ``seeds`` when given."""
    chosen = [STUDIES[k] for k in (keys or STUDIES)]
    return [s if seeds is None else dataclasses.replace(s, seeds=seeds) for s in chosen]


def missing(root: Path, studies: list[Study]) -> list[Job]:
    # study by study, seed by seed, so that an interrupted run leaves whole seeds behind
    return [
        Job(st.key, s, v, k, st.overrides(s, v, k), str(run_dir(st, s, v, k, root)), st.transport(k))
        for st in studies
        for k in st.seeds
        for s in st.settings
        for v in st.variants
        if not finished(run_dir(st, s, v, k, root))
    ]


# ------------------------------------------------------------------ time estimates


def measured_seconds(root: Path) -> dict[tuple[str, str, str], list[float]]:
    """(study, variant, transport) -> the seconds of every finished run of every study: the whole
    job's (``job_seconds``, Ray's start-up included) where recorded, else the run's ``wall_seconds``."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for st in STUDIES.values():
        for s in st.settings:
            for v in VARIANTS:
                for path in sorted((root / st.folder / s / v).glob("seed*")):
                    if finished(path):
                        info = json.loads((path / "summary.json").read_text())
                        out.setdefault((st.key, v, info.get("transport", "grid")), []).append(
                            float(info.get("job_seconds", info["wall_seconds"]))
                        )
    return out


def estimate_seconds(
    measured: dict[tuple[str, str, str], list[float]],
    study: str,
    variant: str,
    transport: str = "grid",
    reference: str = "cheap",
) -> float | None:
    """The expected wall time of one run, from measured runs (``measured``: as
    :func:`measured_seconds`): the mean of the finished runs of the same study, method and
    transport; else of the same study and method on any transport; else the ``reference`` study's
    mean for the method times the median ratio study / reference over the methods both have run;
    else the reference's mean; None when nothing was measured."""

    def mean_of(st: str, v: str, tr: str | None = None) -> float | None:
        values = [x for (s, m, t), xs in measured.items() if s == st and m == v and tr in (None, t) for x in xs]
        return statistics.fmean(values) if values else None

    for value in (mean_of(study, variant, transport), mean_of(study, variant)):
        if value is not None:
            return value
    base = mean_of(reference, variant)
    ratios = [a / b for v in VARIANTS if (a := mean_of(study, v)) is not None and (b := mean_of(reference, v))]
    if base is not None:
        return base * statistics.median(ratios) if ratios else base
    return None


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def plan(root: Path, todo: list[Job], jobs: int) -> list[str]:
    """What ``make results`` will run: per study and setting, the missing runs and their estimated
    time (run time summed, and wall time on ``jobs`` worker processes), then the total."""
    measured = measured_seconds(root)
    lines, total, unknown = [], 0.0, 0
    groups: dict[tuple[str, str], list[Job]] = {}
    for job in todo:
        groups.setdefault((job.study, job.setting), []).append(job)
    for (study, setting), members in groups.items():
        estimates = [estimate_seconds(measured, study, j.variant, j.transport) for j in members]
        known = [e for e in estimates if e is not None]
        total += math.fsum(known)
        unknown += len(estimates) - len(known)
        ray = sum(j.transport == "ray" for j in members)
        ray_unmeasured = ray and not any(k[0] == study and k[2] == "ray" for k in measured)
        lines.append(
            f"  {study} {setting}: {len(members)} run(s) missing ({ray} on Ray), estimated "
            f"{_hours(math.fsum(known))} of run time"
            + (
                f" + {len(estimates) - len(known)} run(s) with nothing measured yet"
                if len(known) < len(estimates)
                else ""
            )
            + (" (Ray runs from in-process times: no Ray run of this study measured yet)" if ray_unmeasured else "")
        )
    lines.append(
        f"make results: {len(todo)} run(s) missing under {root}; estimated {_hours(total)} of run time, "
        f"about {_hours(total / max(1, jobs))} on {jobs} worker process(es)"
        + (f" (+ {unknown} run(s) not estimated)" if unknown else "")
    )
    return lines
