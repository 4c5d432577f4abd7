"""``make results``: run the comparison runs that are missing, then regenerate ``docs/RESULTS.md``.

The comparison (issue "Results a reviewer would accept"): Fashion-MNIST, the CNN, FedHM's four
levels, 20 clients with half of them sampled per round, Dirichlet 0.5 and 0.1, a cosine learning
rate over 30 rounds, seeds 0, 1, 2, and the methods in :data:`VARIANTS`: FedHM, HeteroFL and
FedRolex with widths matched to FedHM's parameters per level, FedAvg on the full and on the
smallest model, and FedHM with self-distillation.

Every run is one job of the project's own server loop (strategy, messages and client handlers as
under ``flwr run``) on the in-process grid (:mod:`fedhm_flwr.local_grid`): the transport is the
only difference, and it is what lets 36 runs fit on a 2-core machine. A finished run is a folder
``results/<setting>/<variant>/seed<k>/`` holding its resolved ``config.yaml``, ``metrics.jsonl``
and ``summary.json`` (committed, a few kB each); a run is written to a temporary folder and
moved into place only when it has finished, so an interrupted ``make results`` leaves no half
run behind and the next one runs only what is missing. The page itself is built by
:func:`fedhm_flwr.summary.write_summary` (tables, paired differences, plots) from those folders:
no number on it is typed by hand.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results"
PAGE = ROOT / "docs" / "RESULTS.md"
FIGURES = ROOT / "docs" / "results"

#: the work every run shares (Hydra overrides of conf/config.yaml)
COMMON = ("dataset=fashion_mnist model=cnn levels.ratios=[1,0.5,0.25,0.125] num_clients=20 fraction_train=0.5 "
          "rounds=30 train.lr_schedule=cosine levels.match=fedhm_params "
          "dataset.max_train_examples=6000 dataset.max_test_examples=3000 tracking.tensorboard=false")
#: one folder per data setting
SETTINGS = {"dir0.5": "partition.scheme=dirichlet partition.alpha=0.5",
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
SEEDS = (0, 1, 2)
#: files of a run that are kept (the rest: checkpoints, plots, event files)
KEEP = ("config.yaml", "metrics.jsonl", "summary.json")


def overrides(setting: str, variant: str, seed: int) -> str:
    return f"{COMMON} {SETTINGS[setting]} {VARIANTS[variant]} seed={seed}"


def run_dir(setting: str, variant: str, seed: int, root: Path = RUNS) -> Path:
    return root / setting / variant / f"seed{seed}"


def finished(path: Path) -> bool:
    return all((path / name).is_file() for name in KEEP)


def one_run(job: tuple[str, str, int, str]) -> dict[str, Any]:
    """Run one job on the in-process grid and move its kept files into place."""
    setting, variant, seed, root = job
    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from fedhm_flwr.config import load_config
    from fedhm_flwr.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.server_app import run

    cfg = load_config(overrides(setting, variant, seed))
    dest = run_dir(setting, variant, seed, Path(root))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp) / "run")
        staged = dest.parent / f".{dest.name}.partial"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for name in KEEP:
            shutil.copy2(Path(tmp) / "run" / name, staged / name)
        with open(staged / "summary.json") as f:
            data = json.load(f)
        data["machine"] = machine()
        data["commit"] = commit()
        data["finished_at"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(staged / "summary.json", "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        staged.rename(dest)
    return {"setting": setting, "variant": variant, "seed": seed,
            "acc": float(summary["final_acc/global"]), "seconds": time.perf_counter() - t0}


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


def missing(root: Path, seeds: tuple[int, ...]) -> list[tuple[str, str, int, str]]:
    # seed by seed, so that an interrupted run leaves whole seeds behind
    return [(s, v, k, str(root)) for k in seeds for s in SETTINGS for v in VARIANTS
            if not finished(run_dir(s, v, k, root))]


def run_missing(root: Path, seeds: tuple[int, ...], jobs: int) -> None:
    todo = missing(root, seeds)
    print(f"make results: {len(todo)} run(s) missing under {root}", flush=True)
    if not todo:
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(one_run, todo):
            print(f"  {r['setting']} {r['variant']:>16} seed {r['seed']}: {r['acc']:.4f} ({r['seconds']:.0f}s)",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="where finished runs are kept")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the missing runs")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only")
    args = parser.parse_args(argv)
    if not args.no_run:
        run_missing(args.runs, tuple(args.seeds), args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
