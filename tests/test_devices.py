"""Real devices on loopback: TLS, SuperNode authentication, nodes that hold only their exported
shard (every other data location pointed at an empty folder), client-side evaluation, a node that
joins late, a node SIGKILLed mid-round and started again at once, and a node whose shard is broken
(fedhm_flwr.ops.deploy.loopback's LocalDeployment, real flower-superlink / `fedhm supernode` processes).

The deployment (:func:`run_deployment`) spends most of its ~2.5 min waiting on Flower's heartbeat
window (the killed node's session lapses 30-60 s after its last heartbeat, then `fedhm supernode`'s
65 s wait before it starts the node again ends), so it runs in a background thread
(tests/conftest.py's session fixture ``devices_deployment``), started with tests/test_deploy.py's TLS
deployment (which waits on a heartbeat window of its own: about a minute after it stopped its
SuperLink); the tests after that one run while it ends. The test here checks the deployment's
outcome (run without the TLS test, the deployment starts with it and the test waits for it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_deploy import ROOT, needs_fmnist

from fedhm_flwr.ops.deploy import loopback as dl
from fedhm_flwr.ops.job.procs import alive, tagged_pids

# Four devices, 3 rounds. node-3's shard is broken: it sits out from the start (asked once). Round 1:
# node-0 and node-1 (node-2 starts during it). Round 2: three nodes; node-1 is SIGKILLed (its whole
# process group: a power cut) as soon as it took its training message and started again at once:
# the SuperLink holds its old session until its heartbeats lapse (30-60 s, inside the 70 s round
# timeout), answers "Node Unavailable" for it, and refuses the new start (`fedhm supernode` waits the
# window out and starts it again). Round 3 waits (up to 90 s) for three usable nodes: node-1 is back
# (~75 s after its kill, and round 2 may end 34 s after it: a wait of up to ~45 s, longer on a loaded
# machine) and trains again, as every node does, at the level it had. Evaluation (the server's and the devices'
# own) after the last round only: round 3, where all three nodes evaluate (one more ClientApp process
# per node and evaluated round, ~8 s a round here). No deployment statistics after the last round (one
# more query to every node, a ClientApp process each; nothing of an export is checked here,
# tests/test_deploy_docs.py exports).
ROUNDS = 3
JOB = [
    "num_clients=3",
    f"rounds={ROUNDS}",
    "fraction_train=1.0",
    "min_train_nodes=2",
    "dataset.max_train_examples=2000",
    "dataset.max_test_examples=300",
    "model.width=4",
    "evaluation.where=both",
    f"evaluation.every={ROUNDS}",
    "evaluation.levels=false",
    "evaluation.deploy_stats=false",
    "timeout=70",
    # every round waits for all its nodes up to the timeout: round 2 for the SuperLink's verdict on the killed
    # node-1 (30-60 s after the kill), a failure of round 2 then, so that round 3 finds node-1's old session
    # gone and waits for its return (ended sooner, round 3 would sample the old session, still listed online,
    # and fail it again); a verdict that comes after its round and amends it: tests/test_killed_supernode.py
    "stragglers.min_seconds=70",
    "availability.min_nodes=3",
    "availability.wait_seconds=90",
    "availability.poll_seconds=1",
]


#: the test below: tests/conftest.py's ``devices_deployment`` runs :func:`run_deployment` only if it is selected
DEVICES_TEST = "test_shard_only_nodes_keep_their_levels_through_a_late_join_and_a_restart"


class Stopped(RuntimeError):
    """The session ended before the deployment did (its test was not reached, e.g. ``pytest -x``)."""


def _until(what, condition, timeout: float, failed=lambda: None, stop: threading.Event | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if failed():
            raise AssertionError(f"the run ended while waiting for {what}: {failed()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if stop is not None and stop.is_set():
            raise Stopped(f"stopped while waiting for {what}")
        time.sleep(0.5)


@dataclass
class Outcome:
    """What the deployment left for its test to check."""

    run_dir: Path
    broken: Path  # node-3's shard folder
    node_ids: dict[str, int]
    logs: dict[str, str]  # flwr-run and node-<i>: the text of each log
    summary: dict[str, Any]
    left_running: list[int]  # processes it started (SuperNodes, the killed one too) alive 1 s after its stop
    left_tagged: list[int]  # any process with its tag then


def run_deployment(tmp_path: Path, stop: threading.Event | None = None) -> Outcome:
    """The deployment of the test below, in ``tmp_path``: export the shards, break node-3's, start the
    SuperLink and the nodes, run JOB, start node-2 late, SIGKILL node-1 and start it again; stop
    everything. Raises what went wrong on the way (a step that timed out, the run's own failure);
    :class:`Stopped` once ``stop`` is set."""
    shards = tmp_path / "shards"
    export = subprocess.run(
        [sys.executable, "-m", "fedhm_flwr.ops.deploy.shard_export", *JOB, f"out={shards}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-2000:]
    broken = shutil.copytree(shards / "partition-0", tmp_path / "broken")  # a shard whose data was altered
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["splits"]["train"]["sha256"] = "0" * 64
    (broken / "manifest.json").write_text(json.dumps(manifest))
    empty = tmp_path / "no-data"
    empty.mkdir()
    hidden = {"FEDHM_DATA_DIR": str(empty), "HOME": str(empty)}  # the device knows only its shard
    run_dir = tmp_path / "run"
    names = [f"node-{i}" for i in range(4)]
    dep = dl.LocalDeployment(tmp_path / "deploy", say=lambda msg: print(f"[devices] {msg}", flush=True))
    result: dict = {}
    folders = [shards / "partition-0", shards / "partition-1", shards / "partition-2", broken]

    def start(i: int):
        return dep.start_supernode(names[i], {"data-dir": str(folders[i])}, extra_env=hidden)

    def job() -> None:
        try:
            result["summary"] = dep.run_job(JOB, run_dir, timeout=900, echo=False)
        except BaseException as err:  # noqa: BLE001  any failure of the job thread is reported by the deployment's thread
            result["error"] = err

    def rounds_done() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def log(name: str = "flwr-run") -> str:
        path = dep.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    pids: list[int] = []
    try:
        dep.make_credentials(names)
        dep.start_superlink()
        for name in names:
            dep.register(name)
        for i in (0, 1, 3):
            start(i)
        dep.wait_online([names[i] for i in (0, 1, 3)])
        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        ended = lambda: result.get("error")  # noqa: E731
        # round 1 has settled its two nodes: a third device starts now and joins in round 2
        _until("round 1's nodes", lambda: log().count(" joined (node id") >= 2, 400, ended, stop)
        start(2)
        _until("round 1", lambda: rounds_done() >= 1, 400, ended, stop)
        # node-1 takes its round-2 training message and dies with all its processes (no goodbye) ...
        _until(
            "node-1's second training message",
            lambda: log("node-1").count("Receiving: train message") >= 2,
            300,
            ended,
            stop,
        )
        killed = dep.supernodes["node-1"]
        pids.append(killed.pid)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        t_kill = time.monotonic()
        start(1)  # ... and is started again at once
        _until("node-1 back", lambda: "node p1 is back" in log(), 300, ended, stop)
        print(f"[devices] node-1 back in the run {time.monotonic() - t_kill:.0f} s after its kill", flush=True)
        pids += [p.pid for p in dep.supernodes.values()]
        _until("the end of the run", lambda: not runner.is_alive(), 900, stop=stop)
        if "error" in result:
            raise result["error"]
    finally:
        dep.close()
    logs = {name: log(name) for name in ["flwr-run", *names]}
    time.sleep(1)
    return Outcome(
        run_dir,
        broken,
        dict(dep.node_ids),
        logs,
        result["summary"],
        [p for p in pids if alive(p)],
        tagged_pids(dep.tag),
    )


@pytest.mark.slow
@needs_fmnist
def test_shard_only_nodes_keep_their_levels_through_a_late_join_and_a_restart(devices_deployment):
    out = devices_deployment.result(timeout=1200)  # the deployment's own failure is raised here
    text, summary, node_ids = out.logs["flwr-run"], out.summary, out.node_ids
    rows = [json.loads(line) for line in (out.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assignments = [json.loads(r["assignments"]) for r in rows]
    # levels stay put: every node trains one level for the whole run, the returning one included
    levels: dict[str, set[float]] = {}
    for trained in assignments:
        for label, level in trained.items():
            levels.setdefault(label, set()).add(level)
    assert set(levels) == {"p0", "p1", "p2"} and all(len(v) == 1 for v in levels.values()), levels
    assert "p2" not in assignments[0] and "p2" in assignments[1]
    # the round node-1 missed: exactly one failure, node-1's, with the true reason; it did not train
    assert rows[1]["sampled"] == 3 and rows[1]["failures"] == 1 and rows[1]["replies"] == 2
    assert json.loads(rows[1]["failure_reasons"]) == [["p1", "node unavailable"]]
    assert "late" not in rows[1] and "late_nodes" not in rows[1], rows[1]
    assert "p1" not in assignments[1] and "p1" in assignments[2]
    assert [r["failures"] for r in rows] == [0, 1, 0]
    assert rows[2]["sampled"] == 3 and rows[2]["replies"] == 3  # the returning node trained with the others
    # the restart: refused while the SuperLink held the old session, then started again by the wrapper,
    # back under the same node id (with SuperNode authentication, Flower 1.42 keeps a node's id)
    assert "[code: 2004] Failed to activate SuperNode" in out.logs["node-1"]
    assert "[fedhm supernode] the SuperLink refused to activate this node" in out.logs["node-1"]
    assert f"node p1 (node id {node_ids['node-1']}) left (node unavailable)" in text
    assert f"node p1 is back (node id {node_ids['node-1']})" in text
    assert "waiting up to 90s for at least 3" in text and "going on" in text
    assert "node p2 joined" in text
    # node-3 sat out every round, with its reason, said so itself once (asked once), and is in the summary
    bad = f"n{node_ids['node-3']}"
    for row in rows:
        assert list(json.loads(row["excluded"])) == [bad] and "checksum" in json.loads(row["excluded"])[bad]
    assert list(summary["excluded"]) == [bad]
    own = [line for line in out.logs["node-3"].splitlines() if "this node sits out of the run:" in line]
    assert len(own) == 1 and "checksum" in own[0] and str(out.broken) in own[0], out.logs["node-3"][-3000:]
    # client-side (federated) evaluation on the devices' held-out shards, per level: after the last
    # round, by all three nodes (the returning one included)
    last = rows[-1]
    assert last["fed_clients"] == 3 and 0 <= last["fed_acc/all"] <= 1, last
    assert any(k.startswith("fed_acc/level_") for k in last)
    assert summary["final_fed_acc/all"] is not None
    # every process it started, the killed node's too, gone 1 s after the deployment stopped
    assert out.left_running == [] and out.left_tagged == []
