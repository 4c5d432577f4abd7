"""``python -m bench.robustness``: the untrusted-clients grid, run where missing, then docs/ROBUSTNESS.md.

    python -m bench.robustness                  # run the missing runs (resumable), then write the page
    python -m bench.robustness --no-run         # the page from the finished runs only
    python -m bench.robustness --status         # runs done / missing and the estimated time left

The grid (:func:`bench.robustness_grid.cells`): FedHM and HeteroFL, the scaling and sign-flip attacks
with 10 % and 30 % of the clients malicious, under every defence the method takes (Krum: FedHM only), plus
the clean run (no attack) under every defence; and FedHM with client-level DP (``dp.enabled``) at
``σ ∈ {0.5, 1, 2}``. Every run is a whole job of the project's own server loop (strategy, messages,
ClientApp handlers) on the in-process grid (:mod:`fedhm_flwr.ops.apps.local_grid`: Flower's transport
replaced, nothing else), in the reduced setting :data:`bench.robustness_grid.COMMON` stated on the page.

A finished run is a folder ``results/robustness/<method>/<condition>/<defence>/seed<k>/`` holding
its ``summary.json`` (the run's own summary plus the overrides, commit, machine and finish time);
a run is staged in a hidden ``.partial`` folder and renamed into place only when it has finished,
so an interrupted grid leaves no half run behind and the next call runs only what is missing (as
``bench/results.py`` does for docs/RESULTS.md). The page is built from those folders alone:
mean and 95 % Student-t interval per cell over seeds, and the paired (same seed) difference to
the method's clean undefended run with its own interval (:mod:`fedhm_flwr.math.stats`). Nothing on it is
typed by hand.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.page_notes import code_lines, recipe_lines, run_version, statistics_line, use_deployable
from bench.robustness_fuzz import FUZZ, dp_accounting_version, pld_text, section as fuzz_section
from bench.robustness_grid import (
    ATTACK_SETTING,
    ATTACKS,
    COMMON,
    DEFENCES,
    DP_CLIP,
    DP_EXPECTED,
    DP_SETTING,
    FRACTIONS,
    LABELS,
    METHODS,
    ROOT,
    RUNS,
    SEEDS,
    SIGMAS,
    Cell,
    cells,
    condition,
    finished,
    load,
)

PAGE = ROOT / "docs" / "ROBUSTNESS.md"
#: the page's name of each attack
ATTACK_NAMES = {
    "clean": "no attack",
    "scale": "scaled update (×100)",
    "sign_flip": "sign-flipped update",
    "label_flip": "label flipping",
    "gaussian": "Gaussian update (same norm)",
}
#: the level of the page's Student-t intervals
CONFIDENCE = 0.95


# ------------------------------------------------------------------ running


def one_run(job: tuple[Cell, int, str]) -> dict[str, Any]:
    """One run on the in-process grid; its summary moved into place when it has finished."""
    cell, seed, root = job
    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from bench.results import commit, machine
    from fedhm_flwr.config import load_config
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run

    overrides = cell.overrides(seed)
    cfg = load_config(overrides)
    code = commit()
    dest = cell.path(seed, Path(root))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp) / "run")
    data = {
        **json.loads(json.dumps(summary, default=str)),
        "overrides": overrides,
        "commit": code,
        "machine": machine(),
        "seconds": time.perf_counter() - t0,
        "finished_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    staged = dest.parent / f".{dest.name}.partial"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    (staged / "summary.json").write_text(json.dumps(data, indent=1, sort_keys=True))
    shutil.rmtree(dest, ignore_errors=True)
    staged.rename(dest)
    return {"cell": cell, "seed": seed, "acc": float(summary["final_acc/global"]), "seconds": data["seconds"]}


def missing(root: Path, seeds: tuple[int, ...], dp: bool = True) -> list[tuple[Cell, int, str]]:
    """Cell by cell in :func:`cells`'s order (``dp=False``: without the DP cells)."""
    return [(c, k, str(root)) for c in cells() for k in seeds if not finished(c.path(k, root)) and (dp or not c.dp)]


def run_missing(root: Path, seeds: tuple[int, ...], jobs: int, limit: int | None = None, dp: bool = True) -> None:
    todo = missing(root, seeds, dp)[:limit]
    print(f"bench.robustness: running {len(todo)} of the missing run(s) under {root}", flush=True)
    if not todo:
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(one_run, todo):
            c = r["cell"]
            print(
                f"  {c.method:>8} {c.condition:>14} {c.defence:>12} seed {r['seed']}: {r['acc']:.4f} "
                f"({r['seconds']:.0f}s)",
                flush=True,
            )


def status(root: Path, seeds: tuple[int, ...], jobs: int) -> str:
    runs = load(root, seeds)
    done = sum(len(v) for v in runs.values())
    todo = len(missing(root, seeds))
    seconds = [float(r["seconds"]) for v in runs.values() for r in v.values()]
    per = statistics.fmean(seconds) if seconds else math.nan
    eta = f"{todo * per / jobs / 60:.0f} min with {jobs} worker(s) at {per:.0f} s per run" if seconds else "unknown"
    return f"{done} run(s) finished, {todo} missing of {done + todo}; estimated time left {eta}"


# ------------------------------------------------------------------ the page


def accuracy(run: dict[str, Any]) -> float:
    return float(run["final_acc/global"])


def estimate(values: list[float]) -> Any:
    from fedhm_flwr.math.stats import mean_ci

    return mean_ci(values, CONFIDENCE)


def pm(est: Any, signed: bool = False) -> str:
    """``mean ± half-width`` in percentage points (``mean (n=1)`` without an interval)."""
    mean = f"{est.mean * 100:+.1f}" if signed else f"{est.mean * 100:.1f}"
    return mean + (f" (n={est.n})" if est.n < 2 else f" ± {est.half_width * 100:.1f}")


def paired_diff(runs: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]]) -> Any:
    """The cell minus the reference, seed by seed (an Estimate), or None without a common seed."""
    diffs = [accuracy(runs[k]) - accuracy(reference[k]) for k in sorted(runs) if k in reference]
    return estimate(diffs) if diffs else None


def cell_text(runs: dict[int, dict[str, Any]] | None, reference: dict[int, dict[str, Any]] | None) -> str:
    if not runs:
        return "–"
    text = pm(estimate([accuracy(r) for r in runs.values()]))
    diff = paired_diff(runs, reference) if reference and runs is not reference else None
    if diff is not None and diff.n >= 2:
        resolved = diff.low > 0 or diff.high < 0
        text += f" ({pm(diff, signed=True)}{'*' if resolved else ''})"
    return text


def resolution(runs: dict[Cell, dict[int, dict[str, Any]]]) -> tuple[float, float, int] | None:
    """(median, largest) half-width of the paired differences' intervals, in points, and how many."""
    halves = []
    for c, by_seed in runs.items():
        ref = runs.get(Cell(c.method, "dp-off" if c.dp else "clean", "none"))
        if ref is None or (c.condition in ("clean", "dp-off") and c.defence == "none"):
            continue
        diff = paired_diff(by_seed, ref)
        if diff is not None and diff.n >= 2:
            halves.append(diff.half_width * 100)
    return (statistics.median(halves), max(halves), len(halves)) if halves else None


def render(root: Path, seeds: tuple[int, ...], command: str = "python -m bench.robustness", fuzz: Path = FUZZ) -> str:
    from fedhm_flwr.math.stats import t_quantile

    runs = load(root, seeds)
    flat = [r for v in runs.values() for r in v.values()]
    use_deployable(flat)  # the deployable accuracy where every run recorded it (bench/page_notes.py)
    expected = len(cells()) * len(seeds)
    complete = all(len(runs.get(c, {})) == len(seeds) for c in cells())
    machines = sorted({str(r.get("machine")) for r in flat})
    hours = sum(float(r["seconds"]) for r in flat) / 3600
    n = len(seeds)
    lines = [
        "# Untrusted clients: attacks, defences and client-level DP",
        "",
        "Generated by `python -m bench.robustness` from the runs kept under `results/robustness/` and the fuzz "
        "campaign's `results/fuzz/fuzz.json`; do not edit by hand. The command runs the missing runs "
        "(resumable), then rebuilds this page.",
        "",
        f"- runs: {len(flat)} of {expected} ({len(cells())} cells × seeds {', '.join(map(str, seeds))})"
        + (
            ""
            if complete
            else " — **the grid is not complete: empty cells are marked –, and cells with fewer "
            "seeds have wider or no intervals**"
        ),
        *code_lines(flat)[0],
        statistics_line(flat),
        f"- page generated {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {'; '.join(machines) or '–'}; total wall time of the runs {hours:.2f} h (worker processes "
        "of one thread each)",
        f"- setting: `{COMMON} {ATTACK_SETTING}` over the default job, i.e. Fashion-MNIST (a seeded 6,000-example "
        "training subset split over 20 clients by Dirichlet(0.5) over labels, a seeded 2,000-example test subset), "
        "the CNN (width 16, about 99k parameters), levels γ = 1, 1/2, 1/4, 1/8 (a fixed level per client, equal "
        "shares), 10 clients sampled per round, 1 local epoch, 20 rounds; the figure is the final global "
        f"model's test accuracy. DP runs and their no-DP reference: `{DP_SETTING}` instead (500 clients of 20 "
        "examples, Poisson-sampled with q = 0.2, 100 expected per round)",
        "- methods: FedHM (softmax(γ/τ) weights) and HeteroFL (width slices), each on its own default options; "
        "training recipe:",
        "",
        *recipe_lines({LABELS[m]: Cell(m, "clean", "none").overrides(0) for m in METHODS}),
        "",
        "- attacks: `failures.attack.kind` with `failures.attack.fraction` 10 % (2 of the 20 clients) and 30 % "
        "(6 of 20), a seeded set fixed for the run that attacks whenever sampled; scale: ×100 "
        "(`failures.attack.scale`)",
        "- defences: `aggregation.robust` with its defaults (clip: bound = median of the round's update norms; "
        "trimmed mean: 20 % cut at each end of an element's covering clients; Krum: f = 1, one reply kept, "
        "FedHM only: HeteroFL's replies do not cover the whole model)",
        f"- DP: `dp.enabled=true dp.clip={DP_CLIP:g}` (DP-FedAvg with the fixed denominator m = fraction_train × "
        f"num_clients = {DP_EXPECTED}, noise std σ·C/m on every element, noise and sampling from OS entropy), ε at "
        "δ = 1e-5 from the project's RDP accountant after the 20 rounds (beside it dp-accounting's PLD ε, "
        "computed by this page's generator)",
        f"- statistics: mean over seeds ± the half-width of its {CONFIDENCE:.0%} Student-t interval "
        "(t with n − 1 degrees of freedom; with n = "
        f"{n} seeds t = {t_quantile((1 + CONFIDENCE) / 2, max(1, n - 1)):.2f}); "
        "in brackets the paired difference to the same method's clean run without defence (same seed: same "
        "partitions, sampling and initial model) ± its own half-width, marked * where that interval excludes 0",
        "",
    ]
    res = resolution(runs)
    if res is not None:
        med, worst, count = res
        lines += [
            f"**What the intervals can resolve.** Over the {count} paired differences on this page the "
            f"{CONFIDENCE:.0%} interval's half-width has median {med:.1f} points (largest {worst:.1f}): a "
            f"difference to the clean run smaller than about {med:.1f} points is not resolved at "
            f"{n} seeds, and a cell without * cannot be told apart from the clean run. Differences "
            "between two defences in the same row are not tested here (their intervals overlap unless "
            "both are far apart); the accuracies' own intervals include the seed-to-seed spread of the "
            "partitions and initial model, which the paired differences remove.",
            "",
        ]
    for method, defences in DEFENCES.items():
        ref = runs.get(Cell(method, "clean", "none"))
        for fraction in FRACTIONS:
            lines += [
                f"## {LABELS[method]}, {fraction:.0%} of the clients malicious",
                "",
                "Final global test accuracy (%) ± 95 % half-width (difference to the clean run without "
                "defence, points).",
                "",
                "| attack | " + " | ".join(f"`{d}`" for d in defences) + " |",
                "|---|" + "---|" * len(defences),
            ]
            for attack in ("clean", *ATTACKS):
                cond = "clean" if attack == "clean" else condition(attack, fraction)
                texts = [cell_text(runs.get(Cell(method, cond, d)), ref) for d in defences]
                lines.append(f"| {ATTACK_NAMES[attack]} | " + " | ".join(texts) + " |")
            lines.append("")
    lines += [
        "## Client-level DP (FedHM)",
        "",
        "Final global test accuracy against the privacy spent after the run's 20 rounds (δ = 1e-5, "
        "q = 0.2); the guarantee covers the released global models only (the per-round metrics are not "
        'private: README, "Untrusted clients"). The difference is paired by seed against the same '
        "federation without DP.",
        "",
        "The runs used the project's RDP accountant (`fedhm_flwr.math.privacy.RdpAccountant`, integer "
        "orders 2 to 256): its ε is the one each run logged and kept as `dp_epsilon` (column RDP). The "
        f"PLD column is not the runs': it is Google's dp-accounting library ({dp_accounting_version()}, "
        "`dp_accounting.pld.PLDAccountant`, pessimistic estimate) on the same mechanism, a Poisson-sampled "
        "Gaussian composed over the rounds, computed by this page's generator from each run's own q "
        "(its `fraction_train`), σ, number of rounds and δ, a tighter bound than RDP's; it is shown only "
        "where those parameters give back the RDP ε the run logged.",
        "",
        "| σ | noise std per element | ε, RDP (the runs') | ε, PLD (dp-accounting) | accuracy (%) | "
        "difference to no DP (points) |",
        "|---|---|---|---|---|---|",
    ]
    ref = runs.get(Cell("fedhm", "dp-off", "none"))
    if ref:
        lines.append(f"| no DP | 0 | ∞ | ∞ | {pm(estimate([accuracy(r) for r in ref.values()]))} | – |")
    for sigma in SIGMAS:
        by_seed = runs.get(Cell("fedhm", f"dp-sigma{sigma:g}", "none"))
        if not by_seed:
            lines.append(f"| {sigma:g} | – | – | – | – | – |")
            continue
        eps = sorted({round(float(r["dp_epsilon"]), 2) for r in by_seed.values()})
        pld = sorted({pld_text(r) for r in by_seed.values()})
        std = sigma * DP_CLIP / DP_EXPECTED
        diff = paired_diff(by_seed, ref) if ref else None
        dtext = (
            "–"
            if diff is None
            else pm(diff, signed=True) + ("*" if diff.n >= 2 and (diff.low > 0 or diff.high < 0) else "")
        )
        lines.append(
            f"| {sigma:g} | {std:g} | {', '.join(f'{e:g}' for e in eps)} | {', '.join(pld)} | "
            f"{pm(estimate([accuracy(r) for r in by_seed.values()]))} | {dtext} |"
        )
    lines += [
        "",
        *fuzz_section(fuzz),
        "## Every run",
        "",
        "| method | condition | defence | seed | accuracy (%) | attackers sampled | rejected | ε | seconds | code |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells():
        for k, r in sorted(runs.get(c, {}).items()):
            eps = f"{float(r['dp_epsilon']):.2f}" if r.get("dp_epsilon") is not None else ""
            lines.append(
                f"| {c.method} | {c.condition} | {c.defence} | {k} | {accuracy(r) * 100:.2f} | "
                f"{int(r.get('attackers_sampled', 0))} | {int(r.get('rejected', 0))} | {eps} | "
                f"{float(r['seconds']):.0f} | {run_version(r)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.robustness", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="where finished runs are kept")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the missing runs")
    parser.add_argument("--limit", type=int, default=None, help="run at most this many of the missing runs")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only")
    parser.add_argument("--no-dp", action="store_true", help="leave the DP cells out of the runs made now")
    parser.add_argument("--status", action="store_true", help="say how many runs are done and missing, and stop")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--fuzz", type=Path, default=FUZZ, help="the fuzz campaign's record (bench.fuzz)")
    args = parser.parse_args(argv)
    seeds = tuple(args.seeds)
    if args.status:
        print(status(args.runs, seeds, args.jobs))
        return 0
    if not args.no_run:
        run_missing(args.runs, seeds, args.jobs, args.limit, dp=not args.no_dp)
    from fedhm_flwr.reporting.results import atomic_write

    atomic_write(args.page, render(args.runs, seeds, fuzz=args.fuzz))
    print(f"bench.robustness: wrote {args.page}; {status(args.runs, seeds, args.jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
