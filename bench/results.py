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
LABELS = {"fedhm": "FedHM", "heterofl": "HeteroFL (matched)", "fedrolex": "FedRolex (matched)",
          "fedavg": "FedAvg, full model", "fedavg_smallest": "FedAvg, smallest FedHM model",
          "fedhm_distill": "FedHM + self-distillation"}
TITLES = {"dir0.5": "Dirichlet α = 0.5", "dir0.1": "Dirichlet α = 0.1 (strongly non-IID)"}
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


# ------------------------------------------------------------------ the page


def _variant_rows(root: Path, setting: str, seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per finished run of ``setting`` (as :func:`fedhm_flwr.summary.collect` reads it),
    named by its variant (``fedavg_smallest`` rather than ``fedavg method.variant=smallest``)."""
    from fedhm_flwr.summary import collect

    dirs = [run_dir(setting, v, k, root) for v in VARIANTS for k in seeds if finished(run_dir(setting, v, k, root))]
    if not dirs:
        return []
    _, rows = collect(dirs)
    for row in rows:
        path = Path(row["dir"])
        row["method"] = path.parent.name
        info = json.loads((path / "summary.json").read_text())
        row.update({k: info.get(k) for k in ("commit", "machine", "finished_at")})
    return rows


def _pct(est: Any) -> str:
    """``80.12 ± 0.34`` (percent; the std only from two values on)."""
    return f"{est.mean * 100:.2f}" + ("" if est.n < 2 else f" ± {est.std * 100:.2f}")


def _pct_ci(est: Any) -> str:
    return "n/a (one seed)" if est.n < 2 else f"[{est.low * 100:.2f}, {est.high * 100:.2f}]"


def paired(rows: list[dict[str, Any]], method: str, reference: str, column: str = "final_acc/global") -> Any:
    """``method − reference`` on the same seeds (an :class:`~fedhm_flwr.stats.Estimate`), or None."""
    from fedhm_flwr.stats import mean_ci

    ref = {r["seed"]: float(r[column]) for r in rows if r["method"] == reference and r.get(column) is not None}
    diffs = [float(r[column]) - ref[r["seed"]] for r in rows
             if r["method"] == method and r.get(column) is not None and r["seed"] in ref]
    return mean_ci(diffs) if diffs else None


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """The headline table of one setting: per method, final and last-10 % global accuracy over
    seeds, the smallest level's accuracy and size, bytes moved and wall time per run."""
    from fedhm_flwr.stats import mean_ci

    smallest = min((k.rsplit("_", 1)[1] for r in rows for k in r if k.startswith("final_acc/level_")),
                   key=float, default=None)
    lines = ["| method | n | final accuracy (%) | 95 % CI | last 10 % of rounds (%) | "
             f"smallest level (γ = {smallest}): accuracy (%) | its parameters | MB moved | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        runs = [r for r in rows if r["method"] == variant]
        if not runs:
            continue
        final = mean_ci([float(r["final_acc/global"]) for r in runs])
        tail = mean_ci([float(r["tail_acc/global"]) for r in runs])
        small = [float(r[f"final_acc/level_{smallest}"]) for r in runs if r.get(f"final_acc/level_{smallest}") is not None]
        params = runs[0].get(f"params/level_{smallest}")
        if variant in ("fedavg", "fedavg_smallest"):  # one model for every client: no levels to evaluate
            small_cell, params = "", runs[0].get("params/level_1") if variant == "fedavg" else params
        else:
            small_cell = _pct(mean_ci(small)) if small else ""
        mb = mean_ci([float(r["bytes_total"]) / 1e6 for r in runs])
        minutes = mean_ci([float(r["wall_seconds"]) / 60 for r in runs])
        params_cell = f"{params:,}" if params else ""
        lines.append(f"| {LABELS[variant]} | {final.n} | {_pct(final)} | {_pct_ci(final)} | {_pct(tail)} | "
                     f"{small_cell} | {params_cell} | {mb.mean:,.1f} | {minutes.mean:.1f} |")
    return lines


def level_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per method and level: the level model's parameters (FedHM's at that level beside a
    budget-matched width), MACs and final accuracy over seeds."""
    from fedhm_flwr.stats import mean_ci

    lines = ["| method | level | parameters | FedHM's parameters | MACs | final accuracy (%) | 95 % CI |",
             "|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        runs = [r for r in rows if r["method"] == variant]
        levels = sorted({k.rsplit("_", 1)[1] for r in runs for k in r if k.startswith("final_acc/level_")},
                        key=lambda x: -float(x))
        for level in levels:
            acc = mean_ci([float(r[f"final_acc/level_{level}"]) for r in runs
                           if r.get(f"final_acc/level_{level}") is not None])
            first = runs[0]
            cells = [first.get(f"{c}/level_{level}") for c in ("params", "fedhm_params", "macs")]
            lines.append(f"| {LABELS[variant]} | {level} | " + " | ".join("" if c is None else f"{c:,}" for c in cells)
                         + f" | {_pct(acc)} | {_pct_ci(acc)} |")
    return lines


def paired_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| method − FedHM | n | final accuracy (pt) | 95 % CI | last 10 % (pt) | 95 % CI | per seed (pt) |",
             "|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        if variant == "fedhm":
            continue
        final, tail = paired(rows, variant, "fedhm"), paired(rows, variant, "fedhm", "tail_acc/global")
        if final is None:
            continue
        ref = {r["seed"]: float(r["final_acc/global"]) for r in rows if r["method"] == "fedhm"}
        per_seed = ", ".join(f"{r['seed']}: {(float(r['final_acc/global']) - ref[r['seed']]) * 100:+.2f}"
                             for r in sorted(rows, key=lambda r: r["seed"])
                             if r["method"] == variant and r["seed"] in ref)
        lines.append(f"| {LABELS[variant]} | {final.n} | {final.mean * 100:+.2f} | {_pct_ci_signed(final)} | "
                     f"{tail.mean * 100:+.2f} | {_pct_ci_signed(tail)} | {per_seed} |")
    return lines


def _pct_ci_signed(est: Any) -> str:
    return "n/a (one seed)" if est.n < 2 else f"[{est.low * 100:+.2f}, {est.high * 100:+.2f}]"


def fedhm_vs_heterofl(rows: list[dict[str, Any]]) -> str:
    """The sentence the page owes its reader: FedHM − HeteroFL with its 95 % CI, whatever its sign."""
    est = paired(rows, "fedhm", "heterofl")
    if est is None:
        return "FedHM − HeteroFL: no seed with both runs yet."
    if est.n < 2:
        return f"FedHM − HeteroFL (budget-matched), final global accuracy: {est.mean * 100:+.2f} pt on one seed (no CI)."
    verdict = ("the interval excludes 0: FedHM is ahead" if est.low > 0 else
               "the interval excludes 0: HeteroFL is ahead" if est.high < 0 else
               "the interval contains 0: no difference can be claimed at this number of seeds")
    return (f"**FedHM − HeteroFL (budget-matched), final global accuracy: {est.mean * 100:+.2f} pt, 95 % CI "
            f"[{est.low * 100:+.2f}, {est.high * 100:+.2f}] over {est.n} paired seeds** ({verdict}).")


def render(root: Path, seeds: tuple[int, ...], figures: Path = FIGURES, page: Path = PAGE) -> str:
    """The Markdown of ``docs/RESULTS.md`` from the finished runs under ``root``; writes the plots
    into ``figures``."""
    from fedhm_flwr.summary import write_plots

    all_rows = {s: _variant_rows(root, s, seeds) for s in SETTINGS}
    runs = [r for rows in all_rows.values() for r in rows]
    expected = len(SETTINGS) * len(VARIANTS) * len(seeds)
    commits = sorted({str(r.get("commit")) for r in runs})
    machines = sorted({str(r.get("machine")) for r in runs})
    hours = sum(float(r["wall_seconds"]) for r in runs) / 3600
    lines = [
        "# Results: FedHM against its baselines on Fashion-MNIST",
        "",
        "Generated by `make results` (`python -m bench.results`) from the runs kept under `results/`; "
        "do not edit by hand. `make results` runs the missing runs, then rebuilds this page and the "
        "headline block of the README.",
        "",
        f"- command: `make results` (runs {len(runs)} of {expected}: {len(SETTINGS)} settings × "
        f"{len(VARIANTS)} methods × seeds {', '.join(map(str, seeds))})",
        f"- code: commit(s) {', '.join(f'`{c}`' for c in commits)} (the commit each run was made with is in its "
        "`summary.json`); page generated " + dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        f"- machine: {'; '.join(machines)}; runs made {min(str(r.get('finished_at')) for r in runs) if runs else '-'}"
        f" to {max(str(r.get('finished_at')) for r in runs) if runs else '-'}; total wall time of the runs "
        f"{hours:.2f} h (2 worker processes, one thread each; wall time of each run below)",
        f"- work: `{COMMON}` with `partition.alpha` 0.5 and 0.1 (Dirichlet over labels), i.e. Fashion-MNIST "
        "(a seeded 6,000-example training subset split over 20 clients, a seeded 3,000-example test subset), "
        "the CNN (width 16) at FedHM's levels γ = 1, 1/2, 1/4, 1/8 (a fixed level per client, equal shares), "
        "10 clients sampled per round, 1 local epoch, 30 rounds with a cosine learning rate",
        "- transport: each run is the project's server loop (strategy, messages, ClientApp handlers) on the "
        "in-process grid (`fedhm_flwr/local_grid.py`) rather than Ray: the transport is the only difference",
        "- methods: " + "; ".join(f"{LABELS[v]}: `{o}`" for v, o in VARIANTS.items()),
        "- statistics: mean ± sample standard deviation over seeds, 95 % confidence intervals from the "
        "Student-t distribution (`fedhm_flwr/stats.py`); paired differences are taken seed by seed (same "
        "partitions, sampling and initial model)",
        "",
    ]
    for setting, rows in all_rows.items():
        if not rows:
            lines += [f"## {TITLES[setting]}", "", "No finished run yet.", ""]
            continue
        out = figures / setting
        write_plots(["method", "seed"], rows, out)
        rel = os.path.relpath(out, page.parent)
        lines += [f"## {TITLES[setting]}", "", fedhm_vs_heterofl(rows), "",
                  "### Headline: final global accuracy", "", *headline(rows), "",
                  "### Paired differences against FedHM (same seed)", "", *paired_table(rows), "",
                  "### Per level", "", *level_table(rows), "",
                  f"![accuracy by round]({rel}/accuracy_by_round.png)", "",
                  f"![accuracy against bytes moved]({rel}/accuracy_vs_bytes.png) "
                  f"![accuracy against parameters]({rel}/accuracy_vs_params.png)", "",
                  f"![accuracy against MACs]({rel}/accuracy_vs_macs.png)", ""]
    lines += ["## Every run", "", "| setting | method | seed | final accuracy (%) | wall time (s) | commit | finished |",
              "|---|---|---|---|---|---|---|"]
    for setting, rows in all_rows.items():
        for r in sorted(rows, key=lambda r: (list(VARIANTS).index(r["method"]), r["seed"])):
            lines.append(f"| {setting} | {r['method']} | {r['seed']} | {float(r['final_acc/global']) * 100:.2f} | "
                         f"{float(r['wall_seconds']):.0f} | {r.get('commit')} | {r.get('finished_at')} |")
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def readme_block(root: Path, seeds: tuple[int, ...]) -> str:
    """The README's quote of the page: the FedHM − HeteroFL sentence and the headline table per setting."""
    lines = [README_START, ""]
    for setting in SETTINGS:
        rows = _variant_rows(root, setting, seeds)
        if rows:
            lines += [f"**{TITLES[setting]}**: {fedhm_vs_heterofl(rows).replace('**', '')}", "", *headline(rows), ""]
    lines += ["Generated by `make results`; details, plots and every run in [docs/RESULTS.md](docs/RESULTS.md).",
              "", README_END]
    return "\n".join(lines)


def update_readme(readme: Path, block: str) -> None:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme}: no {README_START} ... {README_END} block to update")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + block + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="where finished runs are kept")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the missing runs")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README whose results block to update")
    parser.add_argument("--no-readme", dest="readme", action="store_const", const=None, help="leave the README alone")
    args = parser.parse_args(argv)
    seeds = tuple(args.seeds)
    if not args.no_run:
        run_missing(args.runs, seeds, args.jobs)
    from fedhm_flwr.results import atomic_write

    atomic_write(args.page, render(args.runs, seeds, args.figures, args.page))
    if args.readme is not None:
        update_readme(args.readme, readme_block(args.runs, seeds))
    print(f"make results: wrote {args.page}" + (f" and the results block of {args.readme}" if args.readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
