"""Choose the second results setting by measurement: where does the model's capacity matter?

``python -m bench.capacity_probe [--candidates w8 ...] [--seeds 100 101 102]`` runs FedAvg on the full
model and FedAvg on FedHM's smallest model (γ = 1/8) for each candidate setting in
:data:`CANDIDATES` at Dirichlet α = 0.5 over a few seeds (the runs are kept, resumable, under
``results/probe/<candidate>/``, exactly as ``make results`` keeps its runs), then writes
``results/probe/capacity.json`` and ``results/probe/capacity.md``: per candidate the per-seed
accuracies, the paired difference full − smallest with its 95 % Student-t interval, whether it
meets the criterion (at least :data:`MIN_GAP` with an interval excluding 0), the measured wall
time per run and the estimated run time of the whole second study (5 seeds × 6 methods × 2 α)
from those times and the cheap study's per-method times (:func:`bench.studies.estimate_seconds`).
The results page quotes that file; nothing in it is typed by hand. The probe's seeds must be
disjoint from every study's seeds (:func:`check_seeds`): its runs choose the setting, the study's
runs judge the methods in it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench import estimates as E, studies as R
from bench.results import run_missing

PROBE = R.RUNS / "probe"
REPORT = "capacity.json"
#: the criterion: FedAvg full − FedAvg smallest, final global accuracy, in accuracy units
MIN_GAP = 0.03
#: candidate settings: name -> the work every run shares (Hydra overrides)
CANDIDATES = {
    "w8": R.COMMON.replace("model=cnn", "model=cnn model.width=8"),
    "w4": R.COMMON.replace("model=cnn", "model=cnn model.width=4"),
    "full60k": R.COMMON.replace("dataset.max_train_examples=6000", "dataset.max_train_examples=0"),
}
DESCRIPTIONS = {
    "w8": "CNN width 8, 6,000 examples",
    "w4": "CNN width 4, 6,000 examples",
    "full60k": "CNN width 16, all 60,000 training examples",
}
METHODS = ("fedavg", "fedavg_smallest")
#: the probe's seeds: disjoint from every study's (:func:`check_seeds`)
DEFAULT_SEEDS = (100, 101, 102)


def candidate_study(
    name: str, seeds: tuple[int, ...], rounds: int | None = None, ray_seeds: tuple[int, ...] = ()
) -> R.Study:
    common = CANDIDATES[name] if rounds is None else CANDIDATES[name].replace("rounds=30", f"rounds={rounds}")
    folder = f"probe/{name}" if rounds is None else f"probe/{name}-r{rounds}"
    return R.Study(
        f"probe-{name}",
        DESCRIPTIONS[name],
        folder,
        common,
        seeds,
        ray_seeds=ray_seeds,
        settings=("dir0.5",),
        variants=METHODS,
    )


def report(root: Path, names: list[str], seeds: tuple[int, ...], rounds: int | None = None) -> dict[str, Any]:
    """The probe's figures from its finished runs (see the module docstring)."""
    from fedhm_flwr.math.stats import mean_ci

    measured = E.measured_seconds(root)
    full_study = R.STUDIES["capacity"]
    out: dict[str, Any] = {
        "criterion": f"FedAvg full − FedAvg smallest ≥ {MIN_GAP * 100:.0f} pt, 95 % CI excluding 0",
        "alpha": 0.5,
        "generated": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "candidates": {},
    }
    for name in names:
        st = candidate_study(name, seeds, rounds)
        acc: dict[str, dict[int, float]] = {m: {} for m in METHODS}
        secs: dict[str, list[float]] = {m: [] for m in METHODS}
        ray_secs: dict[str, list[float]] = {m: [] for m in METHODS}
        for m in METHODS:
            for k in seeds:
                path = R.run_dir(st, "dir0.5", m, k, root)
                if R.finished(path):
                    info = json.loads((path / "summary.json").read_text())
                    acc[m][k] = float(info["final_acc/global"])
                    (ray_secs if info.get("transport") == "ray" else secs)[m].append(
                        float(info.get("job_seconds", info["wall_seconds"]))
                    )
        both = sorted(set(acc["fedavg"]) & set(acc["fedavg_smallest"]))
        entry: dict[str, Any] = {
            "overrides": st.common,
            "description": DESCRIPTIONS[name],
            "seeds": both,
            "fedavg": [acc["fedavg"][k] for k in both],
            "fedavg_smallest": [acc["fedavg_smallest"][k] for k in both],
            "seconds_per_run": {m: (math.fsum(v) / len(v) if v else None) for m, v in secs.items()},
            "ray_seconds_per_run": {m: (math.fsum(v) / len(v) if v else None) for m, v in ray_secs.items()},
            "ray_seeds": sorted(
                {
                    k
                    for m in METHODS
                    for k in acc[m]
                    if R.finished(R.run_dir(st, "dir0.5", m, k, root))
                    and json.loads((R.run_dir(st, "dir0.5", m, k, root) / "summary.json").read_text()).get("transport")
                    == "ray"
                }
            ),
        }
        if len(both) >= 2:
            est = mean_ci([acc["fedavg"][k] - acc["fedavg_smallest"][k] for k in both])
            entry.update(
                gap_mean=est.mean,
                gap_std=est.std,
                gap_low=est.low,
                gap_high=est.high,
                meets=bool(est.mean >= MIN_GAP and est.low > 0),
            )
        # the whole second study on this candidate: every method's time scaled from the cheap study
        probe_measured = {("capacity", m, "grid"): v for m, v in secs.items() if v}
        probe_measured.update({("capacity", m, "ray"): v for m, v in ray_secs.items() if v})
        # the whole study as make results would run it: each (method, seed, α) on its planned transport
        per_run = {
            (v, t): E.estimate_seconds({**measured, **probe_measured}, "capacity", v, t)
            for v in full_study.variants
            for t in ("grid", "ray")
        }
        if all(x is not None for x in per_run.values()):
            entry["estimated_study_seconds"] = math.fsum(
                per_run[(v, full_study.transport(k))]
                for v in full_study.variants
                for k in full_study.seeds
                for _ in full_study.settings
            )  # type: ignore[misc]
            entry["estimated_seconds_per_method"] = {v: per_run[(v, "grid")] for v in full_study.variants}
        out["candidates"][name] = entry
    return out


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"Capacity probe (`python -m bench.capacity_probe`, {data['generated']}): FedAvg on the full model "
        f"against FedAvg on FedHM's smallest model (γ = 1/8), Dirichlet α = {data['alpha']}, paired by seed; "
        "seconds per run are the whole job's, measured on the shared 2-core machine; the study's estimate "
        "sums every (method, seed, α) on its planned transport, each method's time scaled from the cheap "
        f"study's by the probe's ratio. Criterion: {data['criterion']}.",
        "",
        "| candidate | overrides changed | seeds | FedAvg full (%) | FedAvg smallest (%) | full − smallest (pt) "
        "| 95 % CI | meets | s per run (full, smallest) | s per run on Ray (full, smallest) "
        "| estimated run time of the second study |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in data["candidates"].items():
        changed = " ".join(sorted(set(e["overrides"].split()) - set(R.COMMON.split())))
        gap = f"{e['gap_mean'] * 100:+.2f}" if "gap_mean" in e else "n/a"
        ci = f"[{e['gap_low'] * 100:+.2f}, {e['gap_high'] * 100:+.2f}]" if "gap_low" in e else "n/a"
        s, r = e["seconds_per_run"], e.get("ray_seconds_per_run", {})
        est = e.get("estimated_study_seconds")
        lines.append(
            f"| {name} ({e['description']}) | `{changed}` | {len(e['seeds'])} | "
            + " | ".join(", ".join(f"{a * 100:.2f}" for a in e[m]) for m in METHODS)
            + f" | {gap} | {ci} | {'yes' if e.get('meets') else 'no'} | "
            + ", ".join("-" if s[m] is None else f"{s[m]:.0f}" for m in METHODS)
            + " | "
            + ", ".join("-" if r.get(m) is None else f"{r[m]:.0f}" for m in METHODS)
            + f" | {'-' if est is None else f'{est / 3600:.1f} h'} |"
        )
    return "\n".join(lines) + "\n"


def check_seeds(seeds: tuple[int, ...]) -> None:
    """A setting-selection probe runs on seeds that are none of the studies' seeds: a setting
    chosen on the seeds it is then judged on is chosen for those seeds' luck. SystemExit naming
    ``--seeds``, the overlap and the seeds taken, before anything runs."""
    taken = sorted({k for st in R.STUDIES.values() for k in st.seeds})
    overlap = sorted(set(seeds) & set(taken))
    if overlap:
        raise SystemExit(
            f"--seeds: {', '.join(map(str, overlap))} also seed(s) the studies (their seeds: "
            f"{', '.join(map(str, taken))}); a setting-selection probe takes seeds disjoint from them, "
            f"e.g. --seeds {' '.join(map(str, DEFAULT_SEEDS))}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=["w8"])
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(DEFAULT_SEEDS),
        help="disjoint from the studies' seeds (refused otherwise)",
    )
    parser.add_argument("--rounds", type=int, help="fewer rounds than the study's 30 (a cheaper first look)")
    parser.add_argument("--ray-seeds", type=int, nargs="*", default=[], help="seeds run through flwr run on Ray")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", type=Path, default=R.RUNS)
    parser.add_argument("--no-run", action="store_true", help="report the finished probe runs only")
    args = parser.parse_args(argv)
    seeds = tuple(args.seeds)
    check_seeds(seeds)
    if not args.no_run:
        run_missing(
            args.runs,
            [candidate_study(n, seeds, args.rounds, tuple(args.ray_seeds)) for n in args.candidates],
            args.jobs,
        )
    data = report(args.runs, args.candidates, seeds, args.rounds)
    from fedhm_flwr.reporting.results import atomic_write

    out = args.runs / "probe"
    stem = "capacity" if args.rounds is None else f"capacity-r{args.rounds}"
    atomic_write(out / f"{stem}.json", json.dumps(data, indent=1, sort_keys=True))
    atomic_write(out / f"{stem}.md", markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
