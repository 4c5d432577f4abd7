"""A device's ``flower-supernode`` killed with ``kill -9`` mid-round, through real processes: a SuperLink
with TLS and SuperNode authentication and two SuperNodes (``fedhm supernode``) on loopback
(fedhm_flwr.ops.deploy.loopback's LocalDeployment), with the default ``stragglers.verdict_seconds``. The
round's deadline comes right after the other node's answer, long before Flower's heartbeat window (30-60 s)
lets the SuperLink report the killed node unavailable: the round records it late and does not wait; the
SuperLink's verdict comes in the wait after the last round (the run's only round here) and amends that
round's record as docs/DEPLOY.md says: one failure of that round, ``node unavailable``, not late. The
logic alone: tests/test_late_verdict.py.

About 2 minutes, most of it the heartbeat window."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_deploy import needs_fmnist
from test_devices import _until

from fedhm_flwr.config import load_config, run_options
from fedhm_flwr.ops.deploy import loopback as dl
from fedhm_flwr.ops.deploy.supernode import program
from fedhm_flwr.ops.job.procs import alive, tagged_pids
from fedhm_flwr.server.transport import HEARTBEAT_VERDICT

JOB = [
    "rounds=1",
    "num_clients=2",
    "fraction_train=1.0",
    "min_train_nodes=2",
    "dataset.max_train_examples=600",
    "dataset.max_test_examples=200",
    "model.width=4",
    "evaluation.where=server",
    "evaluation.levels=false",
    "evaluation.deploy_stats=false",
    "timeout=240",
    # the deadline: once one of the two answered, at once (the killed node is late at the deadline)
    "stragglers.quorum=0.5",
    "stragglers.factor=1.0",
    "stragglers.min_seconds=0",
    # (stragglers.verdict_seconds: its default, Flower's heartbeat window and a margin, is how long the run's
    # end waits for the SuperLink's verdict on a device still late)
]


def _flower_supernode(wrapper: int) -> int:
    """The ``flower-supernode`` process that ``fedhm supernode`` (``wrapper``) runs."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == wrapper and program(int(entry.name)) == "flower-supernode":
            return int(entry.name)
    raise AssertionError(f"no flower-supernode under fedhm supernode {wrapper}")


@pytest.mark.slow
@needs_fmnist
def test_a_supernode_killed_mid_round_is_that_rounds_failure_not_late(tmp_path):
    assert run_options(load_config(JOB)).stragglers.verdict_seconds == HEARTBEAT_VERDICT  # the default covers it
    names = ["node-0", "node-1"]
    run_dir, result = tmp_path / "run", {}
    dep = dl.LocalDeployment(tmp_path / "deploy", say=lambda msg: print(f"[killed] {msg}", flush=True))

    def log(name: str = "flwr-run") -> str:
        path = dep.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def job() -> None:
        try:
            result["summary"] = dep.run_job(JOB, run_dir, timeout=600, echo=False)
        except BaseException as err:  # noqa: BLE001  raised in the test's thread below
            result["error"] = err

    try:
        dep.make_credentials(names)
        dep.start_superlink()
        for i, name in enumerate(names):
            dep.register(name)
            # restart_wait=0: the wrapper's start after the kill is refused (the SuperLink holds the old
            # session) and it gives up, so nothing answers for node-1 but the SuperLink
            dep.start_supernode(name, dl.node_config(i, len(names)), restart_wait=0)
        dep.wait_online(names)
        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        took = lambda: "Receiving: train message" in log("node-1")  # noqa: E731
        _until("node-1's training message", took, 400, lambda: result.get("error"))
        killed = _flower_supernode(dep.supernodes["node-1"].pid)
        os.kill(killed, signal.SIGKILL)  # kill -9 <pid of flower-supernode>: no goodbye
        t_kill = time.monotonic()
        _until("the end of the run", lambda: not runner.is_alive(), 400)
        print(f"[killed] the run ended {time.monotonic() - t_kill:.0f} s after the kill", flush=True)
        if "error" in result:
            raise result["error"]
    finally:
        dep.close()
    text, summary = log(), result["summary"]
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the killed node: one failure of its round, with the SuperLink's reason, not late
    assert row["sampled"] == 2 and row["replies"] == 1, row
    assert row["failures"] == 1 and json.loads(row["failure_reasons"]) == [["p1", "node unavailable"]], row
    assert "late" not in row and "late_nodes" not in row and row["amended_at_run_end"] is True, row
    assert list(json.loads(row["assignments"])) == ["p0"]
    assert summary["failures"] == 1
    # the round stopped waiting first (late at the deadline), then the run's end had the SuperLink's verdict
    assert "round 1: node p1 sent no reply before the round's deadline (late)" in text
    said = "the run's end: node p1 failed in round 1: node unavailable (its SuperNode was lost); round 1's record"
    assert said in text
    assert "flower-supernode killed by SIGKILL" in log("node-1")
    assert not alive(killed) and [p for p in tagged_pids(dep.tag) if alive(p)] == []
