"""``fedhm supernode`` with the real Flower: a SuperLink on loopback, the wrapper's real
``flower-supernode``, and a ClientApp busy with a message (it sleeps on it). A ``kill -9`` of the
SuperNode ends its ClientApp at once and brings the device back by itself; a SuperLink stopped under
a busy ClientApp gets the SuperNode started afresh, its ClientApp ended; a SIGTERM stops everything.
(tests/test_supernode_wrapper.py checks the same with stand-ins, in seconds.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fedhm_flwr.ops.deploy import supernode as sn
from fedhm_flwr.ops.job.procs import Processes
from fedhm_flwr.ops.job.superlink import bin_path, flower_env, free_port, start_superlink, write_connection

APP = {
    "pyproject.toml": """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "sleepy"
version = "1.0.0"
description = "one message to every node as it joins; the ClientApp sleeps on it"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "test"

[tool.flwr.app.components]
serverapp = "sleepy:server"
clientapp = "sleepy:client"

[tool.flwr.app.config]
""",
    "sleepy.py": """
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    sent, ids = set(), []
    while True:
        new = [n for n in grid.get_node_ids() if n not in sent]
        ids += list(grid.push_messages([Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=n,
                                                message_type="query") for n in new]))
        sent.update(new)
        list(grid.pull_messages(ids))
        time.sleep(0.5)


@client.query()
def query(msg: Message, context: Context) -> Message:
    time.sleep(300)  # busy with the message
    return Message(RecordDict(), reply_to=msg)
""",
}


def _mine(program: str, home: Path) -> list[int]:
    """Live processes of ``program`` that carry a ``fedhm supernode`` tag and this test's Flower home ``home``
    (other tests' SuperNodes may run beside it: pytest-xdist)."""
    mark = f"FLWR_HOME={home}".encode()

    def ours(env: list[bytes]) -> bool:
        return mark in env and any(v.startswith(sn.TAG_VAR.encode()) for v in env)

    return [p for p in sn._pids() if sn.program(p) == program and sn.alive(p) and ours(sn._proc(p, "environ"))]


@pytest.mark.slow
def test_real_clientapps_end_with_their_supernode_and_their_superlink_and_the_device_comes_back(tmp_path, monkeypatch):
    t0 = time.monotonic()
    home = tmp_path / "node-home"  # the SuperNode's FLWR_HOME: marks this test's processes (_mine)
    app = tmp_path / "sleepy"
    app.mkdir()
    for name, text in APP.items():
        (app / name).write_text(text)
    procs = Processes()
    port = free_port()
    seen: dict[str, float] = {}
    failed: list[BaseException] = []

    def until(what: str, found, timeout: float = 40.0):
        end = time.monotonic() + timeout
        while not (result := found()):
            assert time.monotonic() < end, f"{what}: not within {timeout:g} s"
            time.sleep(0.1)
        seen[what] = time.monotonic()
        return result

    def operator() -> None:  # what happens to the device, while the wrapper runs in the main thread
        try:
            (node,) = until("SuperNode up", lambda: _mine("flower-supernode", home))
            cli = tmp_path / "cli"
            write_connection(cli, "t", f"127.0.0.1:{port}")
            run = subprocess.run(
                [bin_path("flwr"), "run", str(app), "t"],
                env=flower_env(cli),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 0, run.stdout + run.stderr
            first = until("ClientApp busy", lambda: _mine("flwr-clientapp", home))
            os.kill(node, signal.SIGKILL)
            until("ClientApp of the killed SuperNode gone", lambda: not any(sn.alive(p) for p in first), 5)
            until("SuperNode back", lambda: [p for p in _mine("flower-supernode", home) if p != node], 10)
            second = until("ClientApp busy again", lambda: [p for p in _mine("flwr-clientapp", home) if p not in first])
            (back,) = _mine("flower-supernode", home)
            procs.stop_groups([superlink], grace=5.0)
            seen["SuperLink stopped"] = time.monotonic()
            until("ClientApp of the stopped SuperLink gone", lambda: not any(sn.alive(p) for p in second), 10)
            # started afresh (no message of the dead runs left in it), it waits for its SuperLink
            until("SuperNode afresh", lambda: [p for p in _mine("flower-supernode", home) if p != back], 10)
        except BaseException as err:  # noqa: BLE001  reported by the main thread
            failed.append(err)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the wrapper's stop (its handler is installed: it runs)

    ignore = signal.signal(signal.SIGTERM, lambda *_: None)  # what the wrapper restores: a late SIGTERM is lost
    try:
        superlink = start_superlink(
            procs, port, tmp_path / "state.db", flower_env(tmp_path / "link-home"), tmp_path / "superlink.log"
        )
        for key, value in flower_env(home).items():
            monkeypatch.setenv(key, value)  # the SuperNode's environment: the wrapper passes its own on
        thread = threading.Thread(target=operator, daemon=True)
        thread.start()
        code = sn.supervise(
            ["--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port())],
            watch=lambda: sn.LinkWatch(refused_patience=2.0),
            probe_every=(1.0, 0.5),
        )
        thread.join(timeout=30)
    finally:
        signal.signal(signal.SIGTERM, ignore)
        procs.close(grace=5.0, settle=1.0)
    if failed:
        raise failed[0]
    assert code == 0
    assert not any(_mine(name, home) for name in ("flwr-clientapp", "flower-superexec", "flower-supernode"))
    marks = {k: round(v - t0, 1) for k, v in seen.items()}
    print(f"[test] {marks}", flush=True)
    assert seen["ClientApp of the stopped SuperLink gone"] - seen["SuperLink stopped"] < 2.0 + 0.5 + 3.0 + 2.0
