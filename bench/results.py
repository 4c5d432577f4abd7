"""``make results``: run the comparison runs that are missing, then regenerate ``docs/RESULTS.md``.

Two studies, each its own folder of runs (:data:`STUDIES`):

* ``cheap`` (``results/``): Fashion-MNIST on a seeded 6,000-example subset, the CNN at width 16,
  FedHM's four levels, 20 clients with half of them sampled per round, Dirichlet 0.5 and 0.1, a
  cosine learning rate over 30 rounds, seeds 0, 1, 2;
* ``capacity`` (``results/capacity/``): a setting where the model's capacity matters, chosen by
  the measured probe of :mod:`bench.capacity_probe` (its figures: ``results/probe/capacity.json``),
  seeds 0 to 4, one seed per method through ``flwr run`` on Ray.

Each study runs the methods in :data:`VARIANTS`: FedHM, HeteroFL and FedRolex with widths matched
to FedHM's parameters per level, FedAvg on the full and on the smallest model, and FedHM with
self-distillation. Every run is one job of the project's own server loop (strategy, messages and
client handlers as under ``flwr run``), on the in-process grid (:mod:`fedhm_flwr.local_grid`) or,
for a study's ``ray_seeds``, through ``flwr run`` on Flower's Ray simulation engine
(:func:`fedhm_flwr.launch.run_job`); the run's ``summary.json`` records which (``transport``).

A finished run is a folder ``<study root>/<setting>/<variant>/seed<k>/`` holding its resolved
``config.yaml``, ``metrics.jsonl`` and ``summary.json`` (a few kB each); a run is written to a
temporary folder and moved into place only when it has finished, so an interrupted ``make
results`` leaves no half run behind and the next one (in this session or a later one) runs only
what is missing. Before running, ``make results`` prints per study and setting how many runs are
missing and their estimated time, from the measured wall time of the finished runs
(:func:`estimate_seconds`). The page itself is built by :mod:`bench.results_page` from those
folders: no number on it is typed by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results"
PAGE = ROOT / "docs" / "RESULTS.md"
FIGURES = ROOT / "docs" / "results"

#: the work every run of the cheap study shares (Hydra overrides of conf/config.yaml)
COMMON = ("dataset=fashion_mnist model=cnn levels.ratios=[1,0.5,0.25,0.125] num_clients=20 fraction_train=0.5 "
          "rounds=30 train.lr_schedule=cosine levels.match=fedhm_params "
          "dataset.max_train_examples=6000 dataset.max_test_examples=3000 tracking.tensorboard=false")
#: one folder per data setting
ALPHAS = {"dir0.5": "partition.scheme=dirichlet partition.alpha=0.5",
          "dir0.1": "partition.scheme=dirichlet partition.alpha=0.1"}
#: the methods compared: name -> overrides
VARIANTS = {
    "fedhm": "method=fedhm",
    "heterofl": "method=heterofl",
    "fedrolex": "method=fedrolex",
    "fedavg": "method=fedavg",
    "fedavg_smallest": "method=fedavg_smallest",
    "fedhm_distill": "method=fedhm train.distill.enabled=true",
}
LABELS = {"fedhm": "FedHM", "heterofl": "HeteroFL (matched)", "fedrolex": "FedRolex (matched)",
          "fedavg": "FedAvg, full model", "fedavg_smallest": "FedAvg, smallest FedHM model",
          "fedhm_distill": "FedHM + self-distillation"}
TITLES = {"dir0.5": "Dirichlet α = 0.5", "dir0.1": "Dirichlet α = 0.1 (strongly non-IID)"}
#: files of a run that are kept (the rest: checkpoints, plots, event files)
KEEP = ("config.yaml", "metrics.jsonl", "summary.json")
#: how a run's messages travel: ``summary.json``'s ``transport`` (runs without one used the grid)
TRANSPORTS = {"grid": "in-process grid (`fedhm_flwr/local_grid.py`)",
              "ray": "`flwr run` on Flower's Ray simulation engine (`fedhm_flwr/launch.py`)"}


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
        "cheap", "the cheap setting (6,000 examples, CNN width 16)", "", COMMON, (0, 1, 2),
        work="Fashion-MNIST (a seeded 6,000-example training subset split over 20 clients, a seeded "
             "3,000-example test subset), the CNN (width 16) at FedHM's levels γ = 1, 1/2, 1/4, 1/8 (a fixed "
             "level per client, equal shares), 10 clients sampled per round, 1 local epoch, 30 rounds with a "
             "cosine learning rate"),
    "capacity": Study(
        "capacity", "the capacity setting (6,000 examples, CNN width 4)", "capacity", CAPACITY_COMMON,
        (0, 1, 2, 3, 4), ray_seeds=(4,),
        work="as the cheap setting but the CNN at width 4 (hidden sizes 4, 8, 16, 32), where the smallest "
             "level's model holds too little of what the data can teach (see \"Why this setting\")"),
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


def one_run(job: Job) -> dict[str, Any]:
    """Run one job (in-process grid or Ray) and move its kept files into place."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    dest = Path(job.dest)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        if job.transport == "ray":
            from fedhm_flwr.launch import run_job

            summary = run_job(job.overrides.split(), run_dir=out, quiet=True)
        else:
            from fedhm_flwr.config import load_config
            from fedhm_flwr.local_grid import LocalGrid, client_handlers
            from fedhm_flwr.server_app import run

            cfg = load_config(job.overrides)
            summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, out)
        staged = dest.parent / f".{dest.name}.partial"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for name in KEEP:
            shutil.copy2(out / name, staged / name)
        with open(staged / "summary.json") as f:
            data = json.load(f)
        # job_seconds: the whole job as make results waits for it (Ray's start-up and shut-down included)
        data.update(machine=machine(), commit=commit(), transport=job.transport,
                    job_seconds=round(time.perf_counter() - t0, 1),
                    finished_at=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        with open(staged / "summary.json", "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        staged.rename(dest)
    return {**job._asdict(), "acc": float(summary["final_acc/global"]), "seconds": time.perf_counter() - t0}


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "fedhm_flwr", "strategies", "clients", "conf")
    return head + (" (with uncommitted changes)" if dirty else "")


def machine() -> str:
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # pragma: no cover - torch is a dependency
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores, {gpu}"


def studies_with_seeds(keys: list[str] | None = None, seeds: tuple[int, ...] | None = None) -> list[Study]:
    """The studies named (all by default), with their seeds replaced by ``seeds`` when given."""
    chosen = [STUDIES[k] for k in (keys or STUDIES)]
    return [s if seeds is None else dataclasses.replace(s, seeds=seeds) for s in chosen]


def missing(root: Path, studies: list[Study]) -> list[Job]:
    # study by study, seed by seed, so that an interrupted run leaves whole seeds behind
    return [Job(st.key, s, v, k, st.overrides(s, v, k), str(run_dir(st, s, v, k, root)), st.transport(k))
            for st in studies for k in st.seeds for s in st.settings for v in st.variants
            if not finished(run_dir(st, s, v, k, root))]


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
                            float(info.get("job_seconds", info["wall_seconds"])))
    return out


def estimate_seconds(measured: dict[tuple[str, str, str], list[float]], study: str, variant: str,
                     transport: str = "grid", reference: str = "cheap") -> float | None:
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
        lines.append(f"  {study} {setting}: {len(members)} run(s) missing ({ray} on Ray), estimated "
                     f"{_hours(math.fsum(known))} of run time"
                     + (f" + {len(estimates) - len(known)} run(s) with nothing measured yet" if len(known) < len(estimates) else "")
                     + (" (Ray runs from in-process times: no Ray run of this study measured yet)" if ray_unmeasured else ""))
    lines.append(f"make results: {len(todo)} run(s) missing under {root}; estimated {_hours(total)} of run time, "
                 f"about {_hours(total / max(1, jobs))} on {jobs} worker process(es)"
                 + (f" (+ {unknown} run(s) not estimated)" if unknown else ""))
    return lines


def run_missing(root: Path, studies: list[Study], jobs: int) -> None:
    todo = missing(root, studies)
    print("\n".join(plan(root, todo, jobs)), flush=True)
    if not todo:
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(one_run, todo):
            print(f"  {r['study']} {r['setting']} {r['variant']:>16} seed {r['seed']} ({r['transport']}): "
                  f"{r['acc']:.4f} ({r['seconds']:.0f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="where finished runs are kept")
    parser.add_argument("--study", choices=list(STUDIES), nargs="+", help="run only these studies' missing runs")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to run (default: each study's own)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the missing runs")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only")
    parser.add_argument("--plan", action="store_true", help="print the missing runs and their estimated time only")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README whose results block to update")
    parser.add_argument("--no-readme", dest="readme", action="store_const", const=None, help="leave the README alone")
    args = parser.parse_args(argv)
    seeds = tuple(args.seeds) if args.seeds else None
    if args.plan:
        print("\n".join(plan(args.runs, missing(args.runs, studies_with_seeds(args.study, seeds)), args.jobs)))
        return 0
    if not args.no_run:
        run_missing(args.runs, studies_with_seeds(args.study, seeds), args.jobs)
    from bench.results_page import write_page

    write_page(args.runs, args.page, args.figures, args.readme)
    print(f"make results: wrote {args.page}" + (f" and the results block of {args.readme}" if args.readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
