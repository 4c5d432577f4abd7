"""Figure 8: the whole job's wall time, part by part, against an independent bare loop.

The default job runs as ``fedhm run`` does from a shell (``python -m fedhm_flwr run``, what ``make run``
calls: the launcher, a SuperLink, ``flwr run``, Flower's Ray simulation), timed from the process's start to
its exit. Its wall time is broken down from the run's own records: the launcher's ``timings.json``
(process start, config check, SuperLink, app staging, ``flwr run``'s bundle and submission, the end), the
summary (the ServerApp's start, its start-up node queries, the rounds' start and end) and every round's row
(server work, the training phase from push to last reply, the clients' own training seconds, evaluation,
the final statistics query). The bare loop (``python -m bench.whole_job_floor``,
:func:`bench.whole_job_floor.whole_job_floor`, which imports nothing from the project) does the same training
and evaluations on the same data: the job hands it only data, the partitions' indices and each round's
(partition, level) pairs from its rows.

Then the start-up a sweep pays per job: a two-job sweep of 2-round jobs (``fedhm sweep``) with a SuperLink and
a Ray instance per job, with one shared SuperLink (the default, :mod:`fedhm_flwr.ops.sweeps.shared_superlink`),
and with a shared SuperLink and Ray instance (``FEDHM_SHARED_RAY=1``, :mod:`fedhm_flwr.ops.sweeps.shared_ray`):
each job's wall time, its SuperLink's start, and whether every sweep's final models are the first one's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedhm_flwr.config import data_spec, load_config
from fedhm_flwr.data.clients import partition_indices
from fedhm_flwr.data.partitioning import holdout_split

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.3  # the job's wall time ÷ the bare loop's (issue #43)
LAST_ROUND_TARGET = 1.5  # the last round's seconds ÷ the median round's (issue #43)


def last_round_ratio(per_round: list[dict[str, Any]]) -> float:
    """The last round's seconds (its final statistics query included) ÷ the median round's."""
    seconds = [float(r["seconds"]) for r in per_round]
    return seconds[-1] / statistics.median(seconds)


FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run ``cmd`` (output to ``log``); its (start, end) on the wall clock. Raises when it fails."""
    with log.open("wb") as out:
        started = time.time()
        code = subprocess.run(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, check=False
        ).returncode
        ended = time.time()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; see {log}:\n{log.read_text(errors='replace')[-2000:]}")
    return started, ended


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def job_breakdown(
    started: float,
    ended: float,
    marks: dict[str, float],
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    workers: int,
) -> dict[str, Any]:
    """The job's wall time in parts (seconds) that add up to it: start-up, rounds, end."""
    setup_end = summary["rounds_started_at"] - summary["startup_seconds"]
    startup = {
        "process start and imports": marks["launcher_started_at"] - started,
        "config and data check": marks["checked_at"] - marks["launcher_started_at"],
        "SuperLink start": marks["superlink_ready_at"] - marks["checked_at"],
        "app staging": marks["app_staged_at"] - marks["superlink_ready_at"],
        "flwr run: app bundle and submission": marks["run_started_at"] - marks["app_staged_at"],
        "app launch (SuperExec, flwr-simulation, app import)": summary["started_at"] - marks["run_started_at"],
        "ServerApp set-up (test set, model)": setup_end - summary["started_at"],
        "node queries (Ray starts meanwhile)": summary["startup_seconds"],
    }
    client = sum(r.get("client_seconds_sum", 0.0) / max(1, min(workers, r.get("replies", 1))) for r in rows)
    train = sum(r.get("train_seconds", 0.0) for r in rows)
    deploy = sum(r.get("deploy_stats_seconds", 0.0) for r in rows)
    evaluation = sum(r.get("eval_seconds", 0.0) for r in rows)
    server = sum(r.get("server_seconds", 0.0) for r in rows)
    in_rows = sum(r["seconds"] for r in rows)
    rounds = {
        "client training (clients' own seconds ÷ parallel workers)": client,
        "messaging and client set-up (rest of push → last reply)": train - client,
        "server work (sampling, cuts, messages, checks, merge)": server,
        "evaluation (global + levels)": evaluation,
        "final statistics query (past the evaluation)": deploy,
        "rest of the rounds (bookkeeping)": in_rows - train - server - evaluation - deploy,
        "records (rows, checkpoints, summary, plots)": summary["finished_at"] - summary["rounds_started_at"] - in_rows,
    }
    end = {
        "ServerApp end to flwr run's exit": marks["flwr_run_exited_at"] - summary["finished_at"],
        "run status check": marks["status_checked_at"] - marks["flwr_run_exited_at"],
        "clean-up of the job's processes": marks["cleaned_up_at"] - marks["status_checked_at"],
        "process exit": ended - marks["cleaned_up_at"],
    }
    per_round = [
        {
            "round": r["round"],
            "seconds": r["seconds"],
            "eval_seconds": r.get("eval_seconds", 0.0),
            "train_seconds": r.get("train_seconds", 0.0),
            "server_seconds": r.get("server_seconds", 0.0),
        }
        for r in rows
    ]
    return {
        "wall_seconds": ended - started,
        "startup": startup,
        "rounds": rounds,
        "end": end,
        "per_round": per_round,
        "startup_seconds": sum(startup.values()),
        "rounds_seconds": sum(rounds.values()),
        "end_seconds": sum(end.values()),
    }


def workers(cfg: Any) -> int:
    """How many clients the job trains at once: Ray's CPUs (all cores) ÷ each client's ``simulation.num_cpus``."""
    return max(1, (os.cpu_count() or 1) // max(1, int(cfg.simulation.num_cpus)))


def floor_spec(overrides: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the bare loop is handed (data only): the partitions' training indices, each round's
    (partition, level) pairs as the job's rows record them, the levels, the CNN's width, its workers."""
    cfg = load_config(overrides)
    n = int(cfg.num_clients)
    spec = data_spec(cfg, n)
    parts = partition_indices(spec, cfg.dataset.data_dir)
    train = [p[holdout_split(len(p), spec["holdout"], spec["seed"], i)[0]].tolist() for i, p in enumerate(parts)]
    rounds = [
        [(int(label[1:]), float(level)) for label, level in sorted(json.loads(r["assignments"]).items())] for r in rows
    ]
    return {
        "folder": str(cfg.dataset.data_dir or FASHION_MNIST),
        "partitions": train,
        "rounds": rounds,
        "levels": [float(g) for g in cfg.levels.ratios],
        "width": int(cfg.model.width),
        "workers": workers(cfg),
        "test_examples": int(cfg.dataset.max_test_examples),
    }


def run_whole_job(overrides: list[str], tmp: Path, name: str) -> dict[str, Any]:
    """One job through ``fedhm run`` and its bare loop; both walls, their parts and the ratio."""
    run_dir = tmp / name
    started, ended = _spawn(
        [sys.executable, "-m", "fedhm_flwr", "run", "--run-dir", str(run_dir), *overrides], tmp / f"{name}.log"
    )
    cfg = load_config(overrides)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _rows(run_dir)
    job = job_breakdown(started, ended, json.loads((run_dir / "timings.json").read_text()), summary, rows, workers(cfg))
    spec = floor_spec(overrides, rows)
    (tmp / f"{name}-floor.json").write_text(json.dumps(spec))
    f_started, f_ended = _spawn(
        [
            sys.executable,
            "-m",
            "bench.whole_job_floor",
            str(tmp / f"{name}-floor.json"),
            str(tmp / f"{name}-floor-out.json"),
        ],
        tmp / f"{name}-floor.log",
    )
    out = json.loads((tmp / f"{name}-floor-out.json").read_text())
    bare = {
        "wall_seconds": f_ended - f_started,
        "process start and imports": out["main_started_at"] - f_started,
        "data load and model": out["seconds"]["load"],
        "client training": out["seconds"]["train"],
        "server (SVD cuts, multiply back, average)": out["seconds"]["server"],
        "evaluation (global + levels)": out["seconds"]["eval"],
        "process exit": f_ended - out["finished_at"],
        "final_accuracy": out["accuracies"][-1][0],
    }
    return {
        "overrides": overrides,
        "clients": int(cfg.num_clients),
        "per_round": rows[0]["sampled"],
        "rounds": len(rows),
        "workers": spec["workers"],
        "job": job,
        "bare": bare,
        "job_final_accuracy": summary.get("final_acc/global"),
        "ratio": job["wall_seconds"] / bare["wall_seconds"],
        "target": TARGET,
    }


#: the sweeps of the comparison: label -> (FEDHM_SHARED_SUPERLINK, FEDHM_SHARED_RAY); the first is the reference
SWEEP_ARMS = {
    "one SuperLink and one Ray instance per job": ("0", "0"),
    "one shared SuperLink (the default)": ("1", "0"),
    "one shared SuperLink and Ray instance": ("1", "1"),
}


def run_sweep_pair(overrides: list[str], tmp: Path) -> dict[str, Any]:
    """A two-job sweep (seed=0,1) per arm of :data:`SWEEP_ARMS` (what its jobs share): each job's wall time
    (its process tree's, from the launcher's marks), the sweep's, and whether every arm's final models are
    those of the first arm, tensor by tensor."""
    out: dict[str, Any] = {"overrides": [*overrides, "seed=0,1"], "sweeps": {}, "identical_final_models": True}
    for arm, (label, (link, ray)) in enumerate(SWEEP_ARMS.items()):
        sweep_dir = tmp / f"sweep-{arm}"
        started, ended = _spawn(
            [sys.executable, "-m", "fedhm_flwr", "sweep", *overrides, "seed=0,1", f"hydra.sweep.dir={sweep_dir}"],
            tmp / f"sweep-{arm}.log",
            {"FEDHM_SHARED_SUPERLINK": link, "FEDHM_SHARED_RAY": ray},
        )
        jobs = []
        for job in ("job0", "job1"):
            marks = json.loads((sweep_dir / job / "timings.json").read_text())
            summary = json.loads((sweep_dir / job / "summary.json").read_text())
            jobs.append(
                {
                    "job_seconds": marks["cleaned_up_at"] - marks["launcher_started_at"],
                    "startup_seconds": summary["rounds_started_at"] - marks["launcher_started_at"],
                    "superlink_seconds": marks["superlink_ready_at"] - marks["checked_at"],
                    "node_queries_seconds": summary["startup_seconds"],
                }
            )
            reference = tmp / "sweep-0" / job / "checkpoint" / "global_model.safetensors"
            model = sweep_dir / job / "checkpoint" / "global_model.safetensors"
            out["identical_final_models"] &= same_tensors(reference, model)
        out["sweeps"][label] = {"sweep_seconds": ended - started, "jobs": jobs}
    return out


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold the same tensors, bit for bit (not their files' bytes: a checkpoint's
    metadata holds the run's history, wall times included)."""
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def figure_whole_job(quick: bool) -> dict[str, Any]:
    """The default job and a 100-client job (10 per round) against their bare loops; the sweep pair."""
    cut = ["dataset.max_train_examples=6000", "dataset.max_test_examples=2000"] if quick else []
    with tempfile.TemporaryDirectory(prefix="fedhm-bench8-") as name:
        tmp = Path(name)
        default = run_whole_job([*(["rounds=2"] if quick else []), *cut], tmp, "default")
        many = run_whole_job(
            ["num_clients=100", "fraction_train=0.1", *(["rounds=2"] if quick else []), *cut], tmp, "clients100"
        )
        sweep = run_sweep_pair(["rounds=2", *cut], tmp)
    return {"quick": quick, "jobs": {"default": default, "100 clients": many}, "sweep": sweep}


def whole_job_markdown(f8: dict[str, Any]) -> list[str]:
    """Figure 8's section of the report."""
    L = [
        "## 8. The whole job against a bare loop",
        "",
        "Wall time from the process's start to its exit: `python -m fedhm_flwr run` (as `make run`) against "
        "`python -m bench.whole_job_floor` (plain torch, no project import; the same clients, levels, data and "
        "evaluations, on as many one-thread worker processes as the job has one-thread Ray workers). "
        f"Target: job ÷ bare loop ≤ {TARGET:g}; the last round (its final statistics query included) ≤ "
        f"{LAST_ROUND_TARGET:g}× the median round. The job scores a round's models in one pass over the test set, "
        "the layers equal in all of them once (`fedhm_flwr/models/batched.py`); the bare loop scores each model "
        "on its own.",
        "",
        "| job | clients (per round) | rounds | job s | bare loop s | job ÷ bare | last round ÷ median round |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, j in f8["jobs"].items():
        L.append(
            f"| {name} | {j['clients']} ({j['per_round']}) | {j['rounds']} | {j['job']['wall_seconds']:.1f} | "
            f"{j['bare']['wall_seconds']:.1f} | **{j['ratio']:.2f}** | "
            f"**{last_round_ratio(j['job']['per_round']):.2f}** |"
        )
    for name, j in f8["jobs"].items():
        job, bare = j["job"], j["bare"]
        L += [
            "",
            f"**{name}**: `{' '.join(j['overrides']) or '(defaults)'}`; final accuracy job "
            f"{j['job_final_accuracy']:.4f}, bare loop {bare['final_accuracy']:.4f}; {j['workers']} workers each.",
            "",
            "| part | job s | bare loop s |",
            "|---|---|---|",
        ]
        for section, total in (("startup", "start-up"), ("rounds", "rounds"), ("end", "end")):
            L.append(f"| **{total}** | **{job[f'{section}_seconds']:.2f}** | |")
            L += [f"| {part} | {seconds:.2f} | |" for part, seconds in job[section].items()]
        L += [
            f"| bare: {part} | | {bare[part]:.2f} |"
            for part in (
                "process start and imports",
                "data load and model",
                "client training",
                "server (SVD cuts, multiply back, average)",
                "evaluation (global + levels)",
                "process exit",
            )
        ]
        L.append(f"| **total** | **{job['wall_seconds']:.2f}** | **{bare['wall_seconds']:.2f}** |")
    s = f8["sweep"]
    L += [
        "",
        f"**A sweep's jobs** (`fedhm sweep {' '.join(s['overrides'])}`): each job's wall time (launcher start "
        "to its clean-up), its start-up (to round 1) and its node queries (Ray starts meanwhile).",
        "",
        "| shared | sweep s | job 0 s (start-up, SuperLink, queries) | job 1 s (start-up, SuperLink, queries) |",
        "|---|---|---|---|",
    ]
    for label, r in s["sweeps"].items():
        jobs = " | ".join(
            f"{j['job_seconds']:.1f} ({j['startup_seconds']:.1f}, {j.get('superlink_seconds', float('nan')):.1f}, "
            f"{j['node_queries_seconds']:.1f})"
            for j in r["jobs"]
        )
        L.append(f"| {label} | {r['sweep_seconds']:.1f} | {jobs} |")
    L += [
        "",
        "Final models of every sweep identical to the first's, job by job, tensor by tensor, bit for bit: "
        f"**{'yes' if s['identical_final_models'] else 'NO'}**.",
        "",
    ]
    return L
