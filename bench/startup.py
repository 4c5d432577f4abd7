"""Figure 10: each job's time outside its rounds, part by part, against an independent start-up floor
measured in the same run.

The jobs: the default job as ``fedhm run`` runs it from a shell (process start to exit), and the jobs of
a two-job sweep of 2-round jobs (``fedhm sweep rounds=2 seed=0,1``, what the sweep's jobs share as by
default; each job from its launch to its clean-up, the first one from the sweep process's start). A job's
time outside its rounds is its wall time less its rounds' seconds (``metrics.jsonl``); its parts are the
start-up's (``timings.json``'s ``startup_parts``: :mod:`fedhm_flwr.reporting.startup`) and the end's
(the ServerApp's records after the last round, ``flwr run``'s exit, the run's status check, the clean-up).

The floor (``python -m bench.startup_floor``, which imports nothing of the project): import torch and
flwr, ``ray.init`` on 2 CPUs, two actors that import torch and decode the training data, ``ray.shutdown``,
from its spawn to its exit. Target: outside ÷ floor ≤ :data:`TARGET` (issue #53).

    python -m bench.run --only 10          # (make bench ARGS="--only 10"); --quick: small data, a smoke test
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.whole_job import _spawn
from fedhm_flwr.reporting.startup import TIMINGS_FILE, startup_parts

TARGET = 2.0  # a job's time outside its rounds ÷ the floor's (issue #53)
QUICK = ["num_clients=4", "dataset.max_train_examples=2000", "dataset.max_test_examples=500"]  # a smoke test


def floor_parts(spawned: float, exited: float, out: Mapping[str, Any]) -> dict[str, float]:
    """The floor's parts (seconds, in order, adding up to its spawn-to-exit time) from its marks."""
    first_call = min(w["call_started_at"] for w in out["workers"])
    return {
        "Python start": out["main_started_at"] - spawned,
        "server imports (torch, flwr)": out["imported_at"] - out["main_started_at"],
        "ray.init": out["ray_ready_at"] - out["imported_at"],
        "actors start": first_call - out["ray_ready_at"],
        "actors import torch and decode the data": out["workers_ready_at"] - first_call,
        "ray.shutdown": out["finished_at"] - out["workers_ready_at"],
        "process exit": exited - out["finished_at"],
    }


def outside_rounds(
    started: float | None,
    ended: float,
    marks: Mapping[str, Any],
    summary: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """A job's time outside its rounds and its parts: ``started`` (the job's process spawn; None: a job of a
    sweep, from its launch) to ``ended`` (its exit; a sweep's job: its clean-up), its rounds' seconds left
    out. The start-up's parts are the run's own (timings.json, else computed from the marks)."""
    begin = marks.get("launcher_process_started_at", marks["launcher_started_at"]) if started is None else started
    rounds = float(sum(float(r["seconds"]) for r in rows))
    before = dict(marks.get("startup_parts") or startup_parts({**marks, **summary.get("startup_marks", {})}))
    first = min(v for k, v in marks.items() if k.endswith("_at") and isinstance(v, (int, float)))
    if started is not None:
        before = {"process spawn": first - started, **before}
    end = {
        "ServerApp: records after the rounds": summary["finished_at"] - summary["rounds_started_at"] - rounds,
        "ServerApp end to flwr run's exit": marks["flwr_run_exited_at"] - summary["finished_at"],
        "run status check": marks["status_checked_at"] - marks["flwr_run_exited_at"],
        "clean-up of the job's processes": marks["cleaned_up_at"] - marks["status_checked_at"],
        **({"process exit": ended - marks["cleaned_up_at"]} if started is not None else {}),
    }
    wall = ended - begin
    return {
        "wall_seconds": wall,
        "rounds_seconds": rounds,
        "outside_seconds": wall - rounds,
        "before_round_1_seconds": sum(before.values()),
        "before_round_1": before,
        "end": end,
    }


def ratios(job: Mapping[str, Any], floor: Mapping[str, float]) -> dict[str, float]:
    """The job's time outside its rounds ÷ the floor's whole time, and its wait before round 1 ÷ the
    floor's time to its actors' readiness (its exit's parts left out)."""
    whole = sum(floor.values())
    ready = whole - floor["ray.shutdown"] - floor["process exit"]
    return {
        "outside_ratio": job["outside_seconds"] / whole,
        "before_round_1_ratio": job["before_round_1_seconds"] / ready,
    }


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _job(run_dir: Path, started: float | None, ended: float | None) -> dict[str, Any]:
    marks = json.loads((run_dir / TIMINGS_FILE).read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return outside_rounds(
        started, ended if ended is not None else marks["cleaned_up_at"], marks, summary, _rows(run_dir)
    )


def figure_startup(quick: bool) -> dict[str, Any]:
    """The floor, the default job and a two-job sweep of 2-round jobs, in one temporary folder."""
    cut = QUICK if quick else []
    with tempfile.TemporaryDirectory(prefix="fedhm-bench10-") as name:
        tmp = Path(name)
        f_started, f_ended = _spawn(
            [sys.executable, "-m", "bench.startup_floor", str(tmp / "floor.json")], tmp / "floor.log"
        )
        floor = floor_parts(f_started, f_ended, json.loads((tmp / "floor.json").read_text()))
        overrides = [*(["rounds=1"] if quick else []), *cut]
        run_dir = tmp / "default"
        started, ended = _spawn(
            [sys.executable, "-m", "fedhm_flwr", "run", "--no-progress", "--run-dir", str(run_dir), *overrides],
            tmp / "default.log",
        )
        jobs = {"default job": {"overrides": overrides, **_job(run_dir, started, ended)}}
        sweep = ["rounds=2", *cut, "seed=0,1", f"hydra.sweep.dir={tmp / 'sweep'}"]
        _spawn([sys.executable, "-m", "fedhm_flwr", "sweep", *sweep], tmp / "sweep.log")
        for job in ("job0", "job1"):
            jobs[f"2-round sweep, {job}"] = {"overrides": sweep[:-1], **_job(tmp / "sweep" / job, None, None)}
    for job in jobs.values():
        job.update(ratios(job, floor))
    return {"quick": quick, "floor": floor, "jobs": jobs, "target": TARGET}


def startup_markdown(f10: dict[str, Any]) -> list[str]:
    """Figure 10's section of the report."""
    floor = f10["floor"]
    L = [
        "## 10. Time outside the rounds against a start-up floor",
        "",
        "A job's wall time less its rounds' seconds, against `python -m bench.startup_floor` measured in the same "
        "run (no project import: torch + flwr imported, `ray.init` on 2 CPUs, two actors importing torch and "
        f"decoding the training data, `ray.shutdown`): {sum(floor.values()):.1f} s, of which "
        + ", ".join(f"{part} {s:.1f} s" for part, s in floor.items())
        + f". Target: outside ÷ floor ≤ {f10['target']:g}.",
        "",
        "| job | wall s | rounds s | outside s | outside ÷ floor | before round 1 s | before round 1 ÷ floor ready |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, j in f10["jobs"].items():
        L.append(
            f"| {name} | {j['wall_seconds']:.1f} | {j['rounds_seconds']:.1f} | {j['outside_seconds']:.1f} | "
            f"**{j['outside_ratio']:.2f}** | {j['before_round_1_seconds']:.1f} | {j['before_round_1_ratio']:.2f} |"
        )
    for name, j in f10["jobs"].items():
        L += ["", f"**{name}** (`{' '.join(j['overrides']) or '(defaults)'}`):", "", "| part | s |", "|---|---|"]
        L += [f"| before round 1: {part} | {s:.2f} |" for part, s in j["before_round_1"].items()]
        L += [f"| end: {part} | {s:.2f} |" for part, s in j["end"].items()]
    return L
