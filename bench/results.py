"""``make results``: run the comparison runs that are missing, then regenerate ``docs/RESULTS.md``.

Its studies, each its own folder of runs (:data:`bench.studies.STUDIES`):

* ``cheap`` (``results/``): Fashion-MNIST on a seeded 6,000-example subset, the CNN at width 16,
  FedHM's four levels, 20 clients with half of them sampled per round, Dirichlet 0.5 and 0.1, a
  cosine learning rate over 30 rounds, seeds 0, 1, 2;
* ``capacity`` (``results/capacity/``): a setting where the model's capacity matters, chosen by
  the measured probe of :mod:`bench.capacity_probe` (its figures: ``results/probe/capacity.json``),
  seeds 0 to 4, one seed per method through ``flwr run`` on Ray;
* ``full`` (``results/full/``): the whole Fashion-MNIST (60,000 examples) over 50 clients, 10 per
  round, evaluated every few rounds, HeteroFL and FedRolex also matched on training memory; seeds 0
  to 4 at Dirichlet 0.5 (0, 1, 2 of every method first) and 0 to 2 at 0.1;
* ``full_cifar10`` (``results/full_cifar10/``, only with ``--study full_cifar10``): the full study on
  the user's CIFAR-10 (``--data-dir``) with ResNet-18.

A study whose runs do not all record the deployable accuracy on one clean commit (such as
``cheap`` and ``capacity``, whose runs predate it and span several code versions) is shown on the archive page
``docs/RESULTS_ARCHIVE.md`` instead of ``docs/RESULTS.md``, and runs only when named with
``--study`` (:mod:`bench.results_archive`).

``--rounds N`` shortens every selected run to N rounds, evaluated after each (with ``--seeds``,
``--settings`` and ``--variants`` to pick runs): a try-out or a probe, kept apart in
``<study>/rounds<N>/`` and never counted as the study's runs; its seconds per round estimate the
study's runs while none has finished (:mod:`bench.estimates`).

Each study runs the methods in :data:`bench.studies.VARIANTS`: FedHM, HeteroFL and FedRolex with widths matched
to FedHM's parameters per level, FedAvg on the full and on the smallest model, and FedHM with
self-distillation. Every run is one job of the project's own server loop (strategy, messages and
client handlers as under ``flwr run``), on the in-process grid (:mod:`fedhm_flwr.ops.apps.local_grid`) or,
for a study's ``ray_seeds``, through ``flwr run`` on Flower's Ray simulation engine
(:func:`fedhm_flwr.ops.job.launch.run_job`); the run's ``summary.json`` records which (``transport``).

A finished run is a folder ``<study root>/<setting>/<variant>/seed<k>/`` holding its resolved
``config.yaml``, ``metrics.jsonl`` and ``summary.json`` (a few kB each); a run is written to a
temporary folder and moved into place only when it has finished, so an interrupted ``make
results`` leaves no half run behind and the next one (in this session or a later one) runs only
what is missing. Before running, ``make results`` prints per study and setting how many runs are
missing and their estimated time, from measured figures only (:mod:`bench.estimates`). The studies
themselves are defined in :mod:`bench.studies`; the page is built by :mod:`bench.results_page`
from the run folders: no number on it is typed by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

from bench.estimates import plan
from bench.results_archive import archive_page, archived
from bench.studies import (
    ALPHAS,
    FIGURES,
    KEEP,
    PAGE,
    ROOT,
    RUNS,
    STUDIES,
    VARIANTS,
    Job,
    Study,
    missing,
    shortened,
    studies_with_seeds,
)


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
            from fedhm_flwr.ops.job.launch import run_job

            summary = run_job(job.overrides.split(), run_dir=out, quiet=True)
        else:
            from fedhm_flwr.config import load_config
            from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
            from fedhm_flwr.ops.apps.server_app import run

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
        data.update(
            machine=machine(),
            commit=commit(),
            transport=job.transport,
            job_seconds=round(time.perf_counter() - t0, 1),
            finished_at=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        )
        with open(staged / "summary.json", "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        staged.rename(dest)
    return {**job._asdict(), "acc": float(summary["final_acc/global"]), "seconds": time.perf_counter() - t0}


def commit() -> str:
    """The code now: ``abc1234``, ``abc1234 (with uncommitted changes)`` or ``unknown`` (no git)."""
    from fedhm_flwr.reporting.provenance import code_version, version_label

    code = code_version(ROOT)
    return version_label(code["code_commit"], code["code_dirty"])


def machine() -> str:
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except (ImportError, RuntimeError):  # pragma: no cover - torch is a dependency; a broken CUDA set-up
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores, {gpu}"


def check_data(todo: list[Job]) -> None:
    """Refuse, before any run starts, a study whose data is not where its runs would look (e.g. CIFAR-10
    without ``--data-dir``)."""
    from fedhm_flwr.config import load_config
    from fedhm_flwr.data.files import missing_data

    for overrides in {j.study: j.overrides for j in todo}.values():
        d = load_config(overrides).dataset
        for split in ("train", "test"):
            if problem := missing_data(str(d.name), split, d.data_dir, bool(d.download)):
                raise SystemExit(f"make results: {problem}; give the folder with --data-dir")


def run_missing(root: Path, studies: list[Study], jobs: int) -> None:
    todo = missing(root, studies)
    print("\n".join(plan(root, todo, jobs)), flush=True)
    if not todo:
        return
    check_data(todo)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(one_run, todo):
            print(
                f"  {r['study']} {r['setting']} {r['variant']:>16} seed {r['seed']} ({r['transport']}): "
                f"{r['acc']:.4f} ({r['seconds']:.0f}s)",
                flush=True,
            )


def chosen(args: argparse.Namespace, seeds: bool = True) -> list[Study]:
    """The studies the command line selects, with its seeds, methods, rounds and data folder."""
    studies = studies_with_seeds(args.study, tuple(args.seeds) if args.seeds and seeds else None)
    for field, keep in (("variants", args.variants), ("settings", args.settings)):
        if keep:
            studies = [
                dataclasses.replace(st, **{field: tuple(x for x in getattr(st, field) if x in keep)}) for st in studies
            ]
    if args.data_dir:
        if any(c.isspace() for c in args.data_dir):
            raise SystemExit(f"--data-dir: {args.data_dir!r} holds white space (a path without spaces, please)")
        studies = [dataclasses.replace(st, common=f"{st.common} dataset.data_dir={args.data_dir}") for st in studies]
    return [shortened(st, args.rounds) for st in studies] if args.rounds is not None else studies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="where finished runs are kept")
    parser.add_argument("--study", choices=list(STUDIES), nargs="+", help="run only these studies' missing runs")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to run (default: each study's own)")
    parser.add_argument("--variants", choices=list(VARIANTS), nargs="+", help="run only these methods")
    parser.add_argument("--settings", choices=list(ALPHAS), nargs="+", help="run only these data settings")
    parser.add_argument(
        "--rounds",
        type=int,
        help="shorten every run to this many rounds (a probe or a try-out; kept apart in <study>/rounds<N>/)",
    )
    parser.add_argument(
        "--data-dir", help="the folder holding the dataset's files (dataset.data_dir), e.g. cifar-10-batches-py"
    )
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the missing runs")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only")
    parser.add_argument("--plan", action="store_true", help="print the missing runs and their estimated time only")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README whose results block to update")
    parser.add_argument("--no-readme", dest="readme", action="store_const", const=None, help="leave the README alone")
    args = parser.parse_args(argv)
    if args.study is None:  # an archived study runs only when named: topping it up cannot bring it to the standard
        skip = archived(args.runs, studies_with_seeds())
        args.study = [k for k, st in STUDIES.items() if st.default and k not in skip]
        if skip:
            print(f"make results: not running the archived studies {', '.join(skip)} (name them with --study)")
    studies = chosen(args)
    if args.plan:
        print("\n".join(plan(args.runs, missing(args.runs, studies), args.jobs)))
        return 0
    if not args.no_run:
        # the nodes read their data where their node config says, $FEDHM_DATA_DIR on this machine: the same folder
        with mock.patch.dict(os.environ, {"FEDHM_DATA_DIR": args.data_dir} if args.data_dir else {}):
            run_missing(args.runs, studies, args.jobs)
    from bench.results_page import write_page

    shown = {st.key: st for st in chosen(args, seeds=False)} if args.rounds is not None else {}
    write_page(args.runs, args.page, args.figures, args.readme, shown)
    print(
        f"make results: wrote {args.page}, {archive_page(args.page)}"
        + (f" and the results block of {args.readme}" if args.readme else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
