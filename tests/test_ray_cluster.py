"""`simulation.ray_address`: the config check and what reaches ``ray.init``; the runs on an existing
Ray cluster of two nodes are the jobs of the sweep in tests/test_sweep.py (slow)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from fedhm_flwr.ops.job.procs import Processes

RAY = str(Path(sys.executable).parent / "ray")


#: every port handed to a ``ray start`` of this session (one node's worker ports are not bound until its
#: workers start: another node must not be given them)
_GIVEN: set[int] = set()


def distinct_ports(n: int, taken: set[int]) -> list[int]:
    """``n`` free loopback ports, distinct from each other, from ``taken`` and from every port given before
    (``free_port`` closes its socket at once, so two calls may return the same port: here every socket stays
    bound until all ``n`` are found)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = int(s.getsockname()[1])
            if port not in taken and port not in _GIVEN:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    _GIVEN.update(ports)
    return ports


def ray_start(procs: Processes, temp_dir: str, *args: str) -> None:
    """``ray start`` one node of the test's cluster: every port its own free one, its workers' too, all
    distinct (other sessions on this machine may run Ray too: with Ray's default worker range a worker can
    find its port taken by another instance's, crash, and hold the job up for a minute), CPU count 1,
    its files under ``temp_dir``."""
    flags = [
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    ]
    cmd = [
        RAY,
        "start",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *args,
    ]
    named = {int(a.rsplit("=", 1)[1]) for a in args if a.rsplit("=", 1)[-1].isdigit()}
    _GIVEN.update(named)
    ports = distinct_ports(len(flags) + 16, named)
    for flag, port in zip(flags, ports):
        cmd += [flag, str(port)]
    cmd.append(f"--worker-port-list={','.join(map(str, sorted(ports[len(flags) :])))}")
    env = {**procs.env(), "RAY_USAGE_STATS_ENABLED": "0"}
    done = procs.run(cmd, env, timeout=90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_ray_address_is_checked_and_reaches_ray_init(tmp_path, monkeypatch):
    """A bad address is refused by the config check, naming the field; a good one (or none: a private
    instance, never a cluster found on this machine) is what Flower's ``ray.init`` reads (RAY_ADDRESS)."""
    from fedhm_flwr.config import ConfigError, load_config
    from fedhm_flwr.ops.job.launch import superlink_env

    for bad in ("6379", "ray://head:10001", "local"):
        with pytest.raises(ConfigError, match=r"simulation\.ray_address") as err:
            load_config([f"simulation.ray_address={bad}"])
        assert "HOST:PORT" in str(err.value)
    assert load_config(["simulation.ray_address=10.0.0.5:6379"]).simulation.ray_address == "10.0.0.5:6379"
    assert load_config([]).simulation.ray_address is None
    assert superlink_env(tmp_path, 1, "auto")["RAY_ADDRESS"] == "auto"
    assert superlink_env(tmp_path, 1, None)["RAY_ADDRESS"] == "local"
    # a job's own Ray instance starts no idle workers ahead (the clients' actors get their own), unless the
    # caller's environment says otherwise
    assert superlink_env(tmp_path, 1, None)["RAY_prestart_worker_first_driver"] == "0"
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    assert superlink_env(tmp_path, 1, None)["RAY_prestart_worker_first_driver"] == "1"
