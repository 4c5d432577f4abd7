"""Real devices on loopback: TLS, SuperNode authentication, nodes that hold only their exported
shard (every other data location pointed at an empty folder), client-side evaluation, a node that
joins late and a node that is stopped mid-run and started again (scripts/deploy_local.py's
LocalDeployment, real flower-superlink / flower-supernode processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_deploy import ROOT, dl, needs_fmnist

# Three devices, 4 rounds: 1 with two nodes (the third starts during it), 2 with three (node-1
# stopped as it begins: its reply is the SuperLink's "Node Unavailable" once its heartbeat lapses,
# 30-60 s later, inside the 70 s round timeout), 3 with two (node-1 seen gone, started again), 4 with
# three. Each wait for the third node ends at wait_seconds (round 1: two nodes; round 3: node-1 left)
JOB = ["num_clients=3", "rounds=4", "fraction_train=1.0", "min_train_nodes=2", "dataset.max_train_examples=2000",
       "dataset.max_test_examples=300", "model.width=4", "evaluation.where=both", "evaluation.levels=false",
       "timeout=70", "availability.min_nodes=3", "availability.wait_seconds=5", "availability.poll_seconds=1"]


def _until(what, condition, timeout: float, failed=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if failed():
            raise AssertionError(f"the run ended while waiting for {what}: {failed()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.mark.slow
@needs_fmnist
def test_shard_only_nodes_keep_their_levels_through_a_late_join_and_a_restart(tmp_path):
    shards = tmp_path / "shards"
    export = subprocess.run([sys.executable, "-m", "fedhm_flwr.shards", *JOB, f"out={shards}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    empty = tmp_path / "no-data"
    empty.mkdir()
    hidden = {"FEDHM_DATA_DIR": str(empty), "HOME": str(empty)}  # the device knows only its shard
    run_dir = tmp_path / "run"
    names = [f"node-{i}" for i in range(3)]
    dep = dl.LocalDeployment(tmp_path / "deploy", say=lambda msg: print(f"[test] {msg}", flush=True))
    result: dict = {}

    def start(i: int):
        return dep.start_supernode(names[i], {"data-dir": str(shards / f"partition-{i}")}, extra_env=hidden)

    def job() -> None:
        try:
            result["summary"] = dep.run_job(JOB, run_dir, timeout=900, echo=False)
        except BaseException as err:  # reported by the main thread
            result["error"] = err

    def rounds_done() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def log() -> str:
        path = dep.logs / "flwr-run.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    pids: list[int] = []
    try:
        dep.make_credentials(names)
        dep.start_superlink()
        for name in names:
            dep.register(name)
        for i in range(2):
            start(i)
        dep.wait_online(names[:2])
        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        ended = lambda: result.get("error")  # noqa: E731
        # round 1 has settled its two nodes: a third device starts now and joins in round 2
        _until("round 1's nodes", lambda: log().count(" joined (node id") >= 2, 400, ended)
        start(2)
        _until("round 1", lambda: rounds_done() >= 1, 400, ended)
        dl.Processes.stop_groups([dep.supernodes["node-1"]], grace=15)  # node-1 goes away mid-run ...
        _until("the server to see node-1 leave", lambda: "node p1 (node id" in log() and " left" in log(), 300, ended)
        start(1)  # ... and comes back
        pids = [p.pid for p in dep.supernodes.values()]
        runner.join(900)
        assert not runner.is_alive(), "the run did not finish"
        if "error" in result:
            raise result["error"]
    finally:
        dep.close()
    text = log()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    # levels stay put: every node trains one level for the whole run, the returning one included
    levels: dict[str, set[float]] = {}
    for row in rows:
        for label, level in json.loads(row["assignments"]).items():
            levels.setdefault(label, set()).add(level)
    assert set(levels) == {"p0", "p1", "p2"} and all(len(v) == 1 for v in levels.values()), levels
    assert "p2" not in json.loads(rows[0]["assignments"]) and "p2" in json.loads(rows[1]["assignments"])
    assert "p1" in json.loads(rows[-1]["assignments"])
    # the log shows the wait (round 1: two of three), the late join and the return under the same
    # node id (with SuperNode authentication, Flower 1.41 keeps a node's id across restarts)
    assert "waiting up to 5s for at least 3" in text and "going on with the nodes present" in text
    assert "node p2 joined" in text
    assert f"node p1 is back (node id {dep.node_ids['node-1']})" in text
    # client-side (federated) evaluation on the devices' held-out shards, per level
    for row in rows:
        assert row["fed_clients"] > 0 and 0 <= row["fed_acc/all"] <= 1
        assert any(k.startswith("fed_acc/level_") for k in row)
    assert result["summary"]["final_fed_acc/all"] is not None
    time.sleep(1)
    assert not [p for p in pids if dl._alive(p)]
    assert dl.tagged_pids(dep.tag) == []
