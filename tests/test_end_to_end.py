"""Whole runs: in process (fast) and through `flwr run` on the Ray simulation engine (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.reporting.results import CHECKPOINT_DIR, load_checkpoint

OUTPUTS = {"config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "accuracy.png", CHECKPOINT_DIR}


def _check_outputs(out_dir, rounds, levels, nodes):
    assert OUTPUTS <= {p.name for p in out_dir.iterdir()}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    for key in ["acc/global"] + [f"acc/level_{lvl:g}" for lvl in levels]:
        assert 0.0 <= rows[-1][key] <= 1.0
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in rows)
    csv_lines = (out_dir / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == rounds + 1 and "acc/global" in csv_lines[0]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == rounds
    # every node was asked for its node info in the start-up before round 1, none in a round
    assert summary["startup_queried"] == nodes and summary["startup_seconds"] > 0 and summary["startup_bytes"] > 0
    assert all(r["queried"] == 0 for r in rows)
    # (+ the norm statistics of every level gathered after the last round for deployment, when the model has sBN)
    assert summary["bytes_total"] == summary["startup_bytes"] + sum(
        r["bytes_sent"] + r["bytes_received"] + r["bytes_queries"] + r.get("bytes_bn_stats", 0) for r in rows
    )
    state, saved = load_checkpoint(out_dir)
    assert saved["round"] == rounds and state
    assert (out_dir / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows, summary


def test_in_process_run_learns_and_writes_outputs(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=3 train.local_epochs=2 train.lr=0.05")
    _rows, summary = _check_outputs_after(run(LocalGrid(6, client_handlers()), cfg, tmp_path), tmp_path, 3, cfg)
    assert summary["best_acc/global"] > 0.3  # 10 classes: chance is 0.1


def _check_outputs_after(_, out_dir, rounds, cfg):
    return _check_outputs(out_dir, rounds, list(cfg.levels.ratios), int(cfg.num_clients))


@pytest.mark.slow
def test_fedhm_run_of_the_vit_writes_outputs_progress_and_tensorboard_and_leaves_nothing(tmp_path):
    """`fedhm run` (python -m fedhm_flwr) -> launcher -> private SuperLink -> `flwr run` -> Ray, 2 rounds of
    `method=fedhm model=vit`: every output file, one progress line per round on the console (Flower's
    output in flwr_run.log), TensorBoard events every round, no process left. (One run for what were
    three: the launcher's own console is checked in tests/test_lifecycle.py, the built-in CNN through
    `flwr run` there and in tests/test_sweep.py.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "fedhm_flwr",
        "run",
        "method=fedhm",
        "model=vit",
        "model.width=16",
        "model.depth=2",
        "rounds=2",
        "num_clients=2",
        "fraction_train=1.0",
        "dataset.max_train_examples=400",
        "dataset.max_test_examples=200",
        "--run-dir",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    leftover = subprocess.run(["pgrep", "-f", str(out / ".flwr")], capture_output=True, text=True).stdout
    assert leftover.strip() == "", f"processes left running: {leftover}"
    lines = proc.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith("round ")] == ["round 1/2", "round 2/2"]
    assert "run complete: final global accuracy" in lines[-1]
    assert (out / "flwr_run.log").stat().st_size > 0  # Flower's output went to the log, not the console
    rows, summary = _check_outputs(out, 2, [1.0, 0.5, 0.25, 0.125], 2)
    assert sorted(summary["final_acc/level_" + k] is not None for k in ("1", "0.5", "0.25", "0.125")) == [True] * 4
    state, _ = load_checkpoint(out)
    assert state["head.weight"].shape[0] == 10
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for key in ("acc/global", "acc/level_0.125", "loss/global", "bytes_sent", "seconds", "failures"):
        logged = {e.step: e.value for e in acc.Scalars(key)}
        assert logged == pytest.approx({r["round"]: float(r[key]) for r in rows}, rel=1e-6), key


@pytest.mark.slow
def test_launch_refuses_bad_config_before_starting_anything(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run(
        [sys.executable, "-m", "fedhm_flwr.ops.job.launch", "partition.scheme=shards", "--run-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "partition.scheme" in proc.stderr and "dirichlet" in proc.stderr
    assert not out.exists()
