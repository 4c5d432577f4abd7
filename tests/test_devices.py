"""Real devices on loopback: TLS, SuperNode authentication, nodes that hold only their exported
shard (every other data location pointed at an empty folder), client-side evaluation, a node that
joins late, a node SIGKILLed mid-round and started again at once, and a node whose shard is broken
(fedhm_flwr.ops.deployment's LocalDeployment, real flower-superlink / `fedhm supernode` processes)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedhm_flwr.ops import deployment as dl
from fedhm_flwr.ops.procs import alive, tagged_pids
from test_deploy import ROOT, needs_fmnist

# Four devices, 4 rounds. node-3's shard is broken: it sits out from the start (asked once). Round 1:
# node-0 and node-1 (node-2 starts during it). Round 2: three nodes; node-1 is SIGKILLed (its whole
# process group: a power cut) as soon as it took its training message and started again at once:
# the SuperLink holds its old session until its heartbeats lapse (30-60 s, inside the 70 s round
# timeout), answers "Node Unavailable" for it, and refuses the new start (`fedhm supernode` waits the
# window out and starts it again). Round 3 waits (up to 60 s) for three usable nodes: node-1 is back.
# No deployment statistics after the last round (4 more queries to every node, each a ClientApp process:
# over a minute here; nothing of an export is checked here, tests/test_deploy_docs.py exports).
JOB = ["num_clients=3", "rounds=4", "fraction_train=1.0", "min_train_nodes=2", "dataset.max_train_examples=2000",
       "dataset.max_test_examples=300", "model.width=4", "evaluation.where=both", "evaluation.levels=false",
       "evaluation.deploy_stats=false", "timeout=70", "availability.min_nodes=3", "availability.wait_seconds=60",
       "availability.poll_seconds=1"]


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
    export = subprocess.run([sys.executable, "-m", "fedhm_flwr.ops.shards", *JOB, f"out={shards}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
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
    dep = dl.LocalDeployment(tmp_path / "deploy", say=lambda msg: print(f"[test] {msg}", flush=True))
    result: dict = {}
    folders = [shards / "partition-0", shards / "partition-1", shards / "partition-2", broken]

    def start(i: int):
        return dep.start_supernode(names[i], {"data-dir": str(folders[i])}, extra_env=hidden)

    def job() -> None:
        try:
            result["summary"] = dep.run_job(JOB, run_dir, timeout=900, echo=False)
        except BaseException as err:  # reported by the main thread
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
        _until("round 1's nodes", lambda: log().count(" joined (node id") >= 2, 400, ended)
        start(2)
        _until("round 1", lambda: rounds_done() >= 1, 400, ended)
        # node-1 takes its round-2 training message and dies with all its processes (no goodbye) ...
        _until("node-1's second training message", lambda: log("node-1").count("Receiving: train message") >= 2,
               300, ended)
        killed = dep.supernodes["node-1"]
        pids.append(killed.pid)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        t_kill = time.monotonic()
        start(1)  # ... and is started again at once
        _until("node-1 back", lambda: "node p1 is back" in log(), 300, ended)
        print(f"[test] node-1 back in the run {time.monotonic() - t_kill:.0f} s after its kill", flush=True)
        pids += [p.pid for p in dep.supernodes.values()]
        runner.join(900)
        assert not runner.is_alive(), "the run did not finish"
        if "error" in result:
            raise result["error"]
    finally:
        dep.close()
    text = log()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
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
    assert "p1" not in assignments[1] and "p1" in assignments[2] and "p1" in assignments[3]
    assert [r["failures"] for r in rows] == [0, 1, 0, 0]
    # the restart: refused while the SuperLink held the old session, then started again by the wrapper,
    # back under the same node id (with SuperNode authentication, Flower 1.41 keeps a node's id)
    assert "[code: 2004] Failed to activate SuperNode" in log("node-1")
    assert "[fedhm supernode] the SuperLink refused to activate this node" in log("node-1")
    assert f"node p1 (node id {dep.node_ids['node-1']}) left (node unavailable)" in text
    assert f"node p1 is back (node id {dep.node_ids['node-1']})" in text
    assert "waiting up to 60s for at least 3" in text and "going on" in text
    assert "node p2 joined" in text
    # node-3 sat out every round, with its reason, said so itself once (asked once), and is in the summary
    bad = f"n{dep.node_ids['node-3']}"
    for row in rows:
        assert list(json.loads(row["excluded"])) == [bad] and "checksum" in json.loads(row["excluded"])[bad]
    assert list(result["summary"]["excluded"]) == [bad]
    own = [line for line in log("node-3").splitlines() if "this node sits out of the run:" in line]
    assert len(own) == 1 and "checksum" in own[0] and str(broken) in own[0], log("node-3")[-3000:]
    # client-side (federated) evaluation on the devices' held-out shards, per level
    for row in rows:
        assert row["fed_clients"] > 0 and 0 <= row["fed_acc/all"] <= 1
        assert any(k.startswith("fed_acc/level_") for k in row)
    assert result["summary"]["final_fed_acc/all"] is not None
    time.sleep(1)
    assert not [p for p in pids if alive(p)]
    assert tagged_pids(dep.tag) == []
