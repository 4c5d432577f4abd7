"""`simulation.ray_address`: a run's clients on an existing Ray cluster of two nodes (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fedhm_flwr.launch import free_port
from fedhm_flwr.procs import Processes, tagged_pids

RAY = str(Path(sys.executable).parent / "ray")


def _ray_start(procs: Processes, temp_dir: str, *args: str) -> None:
    """``ray start`` one node of the test's cluster: every port its own free one (other sessions on
    this machine may run Ray too), CPU count 1, its files under ``temp_dir``."""
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
             "--metrics-export-port"]
    cmd = [RAY, "start", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--temp-dir={temp_dir}",
           "--disable-usage-stats", *args]
    for flag in ports:
        cmd += [flag, str(free_port())]
    env = {**procs.env(), "RAY_USAGE_STATS_ENABLED": "0"}
    done = procs.run(cmd, env, timeout=90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_two_rounds_on_a_two_node_ray_cluster(tmp_path):
    """Head + one more node (1 CPU each): the run completes and its clients train on both nodes."""
    if not Path(RAY).exists():
        pytest.skip("no `ray` executable next to this Python")
    temp_dir = tempfile.mkdtemp(prefix="fedhm-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    gcs = free_port()
    procs = Processes()  # the cluster's processes carry this tag: stopped by it, and only they
    try:
        _ray_start(procs, temp_dir, "--head", f"--port={gcs}", "--include-dashboard=false",
                   f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}")
        _ray_start(procs, temp_dir, f"--address=127.0.0.1:{gcs}")
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "fedhm_flwr.launch", "rounds=2", "num_clients=4", "fraction_train=1.0",
               "dataset.max_train_examples=800", "dataset.max_test_examples=200", "model.width=4",
               "evaluation.levels=false", f"simulation.ray_address=127.0.0.1:{gcs}", "--run-dir", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2]
        assert all(r["replies"] == 4 for r in rows)
        # 4 clients a round, one 1-CPU actor per node: both nodes train in each round
        assert [r.get("ray_nodes") for r in rows] == [2, 2], rows
    finally:
        procs.close(grace=5.0, settle=1.0)
        left = tagged_pids(procs.tag)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"cluster processes left running: {left}"


def test_ray_address_is_checked_and_reaches_ray_init(tmp_path):
    """A bad address is refused by the config check, naming the field; a good one (or none: a private
    instance, never a cluster found on this machine) is what Flower's ``ray.init`` reads (RAY_ADDRESS)."""
    from fedhm_flwr.config import ConfigError, load_config
    from fedhm_flwr.launch import superlink_env

    for bad in ("6379", "ray://head:10001", "local"):
        with pytest.raises(ConfigError, match="simulation.ray_address") as err:
            load_config([f"simulation.ray_address={bad}"])
        assert "HOST:PORT" in str(err.value)
    assert load_config(["simulation.ray_address=10.0.0.5:6379"]).simulation.ray_address == "10.0.0.5:6379"
    assert load_config([]).simulation.ray_address is None
    assert superlink_env(tmp_path, 1, "auto")["RAY_ADDRESS"] == "auto"
    assert superlink_env(tmp_path, 1, None)["RAY_ADDRESS"] == "local"
