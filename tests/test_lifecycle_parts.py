"""The parts of a run's lifecycle, each in seconds with real processes: the run lock (a live
holder refused, its own job let in, a dead one's file ignored), the watchdog that stops every
process of a launcher killed outright, the cleanup that kills Ray's workers at once, refusals
before anything starts (CIFAR missing, resume without a checkpoint, status of a non-run), the
launcher's scan for the ServerApp's exception and the ServerApp's watch on its SuperLink. The
whole runs interrupted and resumed are in tests/test_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from lifecycle_helpers import ROOT, descendants, fedhm_status, is_alive, process_state

from fedhm_flwr.ops.apps.superlink_watch import runtime_address, watch_superlink
from fedhm_flwr.ops.job.procs import Processes, kill_tagged
from fedhm_flwr.ops.job.runlock import RunDirectoryBusy, RunLock

HOLDER = """
import sys, time
from fedhm_flwr.ops.job.runlock import RunLock
lock = RunLock(sys.argv[1], tag="job-1").acquire()
print("locked", flush=True)
time.sleep(300)
"""


def test_run_lock_refuses_a_live_holder_lets_its_own_job_in_and_ignores_a_dead_ones_file(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 2**22 + 7, "tag": "old"}))  # left by a dead run
    RunLock(tmp_path).acquire().release()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirectoryBusy) as refused:
            RunLock(tmp_path, tag="job-2").acquire()
        assert str(tmp_path) in str(refused.value) and f"PID {holder.pid}" in str(refused.value)
        assert RunLock(tmp_path, tag="job-1").acquire().fd is None  # the holder's own job (its ServerApp)
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path, tag="job-2").acquire().release()  # the kernel dropped the dead holder's lock


LAUNCHER = """
import os, sys, time
from fedhm_flwr.ops.job.procs import Processes
procs = Processes()
own = procs.start("own", ["sleep", "300"], dict(os.environ), None)
# a child that leaves its session, and one in a tagged session whose environment lost the tag
shell = procs.start("shell", ["sh", "-c", "setsid sleep 301 & env -i /bin/sleep 302 & wait"], dict(os.environ), None)
print(procs.tag, procs.watchdog.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_stops_every_process_of_a_launcher_killed_outright(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    tag, watchdog = launcher.stdout.readline().split()
    deadline = time.monotonic() + 30
    pids: set[int] = set()
    while len(pids) < 5:  # the watchdog, sleep 300, sh, sleep 301 (own session), sleep 302 (no tag)
        assert time.monotonic() < deadline, pids
        time.sleep(0.1)
        pids = {p for p in descendants(launcher.pid) if is_alive(p)}
    assert int(watchdog) in pids
    assert f"FEDHM_RUN_TAG={tag}".encode() not in Path(f"/proc/{watchdog}/environ").read_bytes()  # not a target
    t0 = time.monotonic()
    launcher.kill()
    launcher.wait()
    while any(is_alive(p) for p in pids):
        assert time.monotonic() - t0 < 10, {p: process_state(p) for p in pids if is_alive(p)}
        time.sleep(0.1)


STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
)
POLITE = (
    "import signal, sys, time\n"
    "def stop(*_):\n    open(sys.argv[1], 'w').write('SIGTERM')\n    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop); print('up', flush=True); time.sleep(300)"
)


def test_a_cleanup_kills_rays_workers_at_once_and_asks_every_other_process_to_stop_first(tmp_path):
    """Ray's agents outlive their raylet and ignore SIGTERM for seconds (``ray::DashboardAgent``): the
    cleanup kills a tagged process titled ``ray::...`` without a grace period or a settle wait, and
    still gives any other process SIGTERM first (its handler runs)."""
    env = dict(os.environ)
    ray_job, other_job = Processes(watchdog=False), Processes(watchdog=False)
    agent = ray_job.start(
        "agent", ["bash", "-c", f'exec -a ray::FakeAgent "{sys.executable}" -c "{STUBBORN}"'], env, None
    )
    polite = other_job.start("polite", [sys.executable, "-c", POLITE, str(tmp_path / "termed")], env, None)
    for proc in (agent, polite):
        assert proc.stdout.readline().strip() == b"up"
    assert Path(f"/proc/{agent.pid}/cmdline").read_bytes().startswith(b"ray::FakeAgent\0")
    t0 = time.monotonic()
    assert kill_tagged(ray_job.tag, grace=120.0, settle=120.0) == [agent.pid]
    assert time.monotonic() - t0 < 60  # neither the settle wait nor the grace period was spent on it
    assert agent.wait(timeout=5) == -signal.SIGKILL
    assert kill_tagged(other_job.tag, grace=120.0) == [polite.pid]
    assert polite.wait(timeout=5) == 0 and (tmp_path / "termed").read_text() == "SIGTERM"


#: the real launcher, run with an audit hook that writes down every process it starts (to argv[1])
_NO_PROCESS_PROBE = """
import runpy, sys
out, started = sys.argv[1], []
SPAWNS = {"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.system"}
sys.addaudithook(lambda event, args: started.append(event) if event in SPAWNS else None)
sys.argv = ["fedhm_flwr.ops.job.launch", *sys.argv[2:]]
try:
    runpy.run_module("fedhm_flwr.ops.job.launch", run_name="__main__")
finally:
    open(out, "w").write(" ".join(started))
"""


def test_missing_cifar_fails_at_once_with_one_line_and_starts_nothing(tmp_path):
    """dataset=cifar10 with no CIFAR data: the real launcher exits 2 before it starts anything (no
    process: an audit hook sees every one it would start; no run directory), with one line naming
    dataset.data_dir / FEDHM_DATA_DIR."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "FEDHM_DATA_DIR": str(empty)}
    started = tmp_path / "started"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _NO_PROCESS_PROBE,
            str(started),
            "dataset=cifar10",
            f"dataset.data_dir={empty}",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "dataset.data_dir" in line and "FEDHM_DATA_DIR" in line and "Traceback" not in proc.stderr
    assert started.read_text() == ""  # no process started (the probe's hook saw none)
    assert not (tmp_path / "run").exists()


def test_error_scan_takes_the_serverapps_exception_from_flowers_own_log_lines():
    """The line Flower's logger writes for a ServerApp that raised, then the traceback: the scan
    keeps the exception's own line (what the console's `why:` shows)."""
    import io
    import logging

    from flwr.common.logger import log

    from fedhm_flwr.ops.job.launch import ErrorScan

    handler = next(h for h in logging.getLogger("flwr").handlers if isinstance(h, logging.StreamHandler))
    buffer = io.StringIO()
    stream = handler.setStream(buffer)  # Flower's own console handler and format, into a buffer
    try:
        try:
            raise ValueError("dataset.path: /data/x/bad.png is not a readable image")
        except ValueError as ex:
            log(logging.ERROR, "ServerApp raised an exception", exc_info=ex)
    finally:
        handler.setStream(stream)
    told: list[str] = []
    scan = ErrorScan(told.append)
    for line in buffer.getvalue().splitlines():
        scan.feed(line)
    assert "Traceback" in buffer.getvalue()
    assert scan.server == "ValueError: dataset.path: /data/x/bad.png is not a readable image", buffer.getvalue()
    assert told == [f"ServerApp error: {scan.server}"] and scan.reason() == f"ServerApp: {scan.server}"


def test_resume_without_a_checkpoint_and_status_of_a_non_run_are_refused_at_once(tmp_path):
    """`fedhm resume` of a run that stopped before its first checkpoint: exit 2 in seconds, one line
    naming the folder, nothing started (no lock, no Flower state); `fedhm status` of a folder that
    holds no run: exit 2."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("rounds: 2\n")  # what a run writes before its first round
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fedhm_flwr", "resume", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert str(run_dir / "checkpoint") in line and "holds none" in line, line
    assert time.monotonic() - t0 < 15
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
    status = fedhm_status(tmp_path)
    assert status.returncode == 2 and "not a run directory" in status.stderr


def test_the_serverapp_watch_fires_only_once_its_superlinks_port_refuses_connections():
    """The ServerApp's watch (superlink_watch.watch_superlink): quiet while something listens on the
    SuperLink's address (its own ``--runtime-api-address``), on_gone once the port refuses."""
    assert runtime_address(["flwr-serverapp", "--runtime-api-address", "127.0.0.1:9091", "--token", "x"]) == (
        "127.0.0.1",
        9091,
    )
    assert runtime_address(["flwr-serverapp", "--runtime-api-address", "[::1]:9091"]) == ("::1", 9091)
    assert runtime_address(["python", "-m", "pytest"]) is None
    listener = socket.create_server(("127.0.0.1", 0))
    gone = threading.Event()
    watch_superlink(listener.getsockname()[:2], gone.set, every=0.1, misses=3)
    assert not gone.wait(1.5)  # 15 checks while it listens
    listener.close()
    t0 = time.monotonic()
    assert gone.wait(5)
    assert time.monotonic() - t0 < 2
