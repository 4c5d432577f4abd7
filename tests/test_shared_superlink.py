"""One SuperLink for a sweep's jobs (fedhm_flwr/ops/sweeps/shared_superlink.py): when a sweep starts one, which
jobs join it, that a job's ServerApp may enter its locked run directory, and that a job stops its own run's
processes on it and not the SuperLink. (A real sweep through it: tests/test_lifecycle.py's Ctrl-C to a sweep,
which runs with the default, a shared SuperLink; bench figure 8 compares the final models.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fedhm_flwr.ops.job.procs import TAG_VAR, command_name, new_tag
from fedhm_flwr.ops.job.runlock import RunDirectoryBusy, RunLock
from fedhm_flwr.ops.job.superlink import GUARD_MODULE
from fedhm_flwr.ops.sweeps import multirun, shared_superlink
from fedhm_flwr.ops.sweeps.shared_superlink import SHARED_SUPERLINK_SWITCH, SHARED_SUPERLINK_VAR, handed_down

SHARED = {"address": "127.0.0.1:4242", "tag": "abc", "ray_address": None}


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("0", False), ("Off", False), ("no", False)])
def test_the_switch_is_on_unless_turned_off(value, on):
    assert shared_superlink.enabled({SHARED_SUPERLINK_SWITCH: value} if value else {}) is on


def test_a_job_joins_the_handed_down_superlink_only_for_the_same_ray_address():
    env = {SHARED_SUPERLINK_VAR: json.dumps(SHARED)}
    shared = handed_down(None, env)
    assert shared is not None and (shared.port, shared.tag, shared.ray_address) == (4242, "abc", None)
    assert handed_down("", env) == shared  # an empty simulation.ray_address is no address
    assert handed_down("10.0.0.1:6379", env) is None  # its runs would use another Ray cluster
    on_ray = {SHARED_SUPERLINK_VAR: json.dumps({**SHARED, "ray_address": "127.0.0.1:6379"})}
    assert handed_down("127.0.0.1:6379", on_ray) is not None and handed_down(None, on_ray) is None


@pytest.mark.parametrize("raw", ["", "{", "[]", '{"tag": "a"}', '{"address": "nohost", "tag": "a"}'])
def test_a_malformed_hand_down_starts_the_jobs_own(raw):
    assert handed_down(None, {SHARED_SUPERLINK_VAR: raw}) is None


@pytest.mark.parametrize(
    "env, overrides",
    [
        ({SHARED_SUPERLINK_SWITCH: "0"}, ["seed=0,1"]),
        ({SHARED_SUPERLINK_VAR: json.dumps(SHARED)}, ["seed=0,1"]),
        ({}, ["seed=0,1", "simulation.ray_address=auto"]),
        ({}, ["seed=0,1", "hydra/launcher=joblib"]),
    ],
)
def test_a_sweep_starts_no_superlink_when_off_handed_down_on_a_cluster_or_side_by_side(monkeypatch, env, overrides):
    for key in (SHARED_SUPERLINK_SWITCH, SHARED_SUPERLINK_VAR, "FEDHM_SHARED_RAY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(multirun, "shared_superlink", lambda *a: pytest.fail("a shared SuperLink was started"))
    with multirun.sweep_services(overrides) as extra:
        assert SHARED_SUPERLINK_VAR not in extra


def test_a_plain_sweep_starts_one_and_hands_it_down(monkeypatch):
    for key in (SHARED_SUPERLINK_SWITCH, SHARED_SUPERLINK_VAR, "FEDHM_SHARED_RAY"):
        monkeypatch.delenv(key, raising=False)
    started = []

    class _Link:
        def __init__(self, ray_address):
            started.append(ray_address)

        def __enter__(self):
            return {SHARED_SUPERLINK_VAR: "x"}

        def __exit__(self, *exc):
            started.append("stopped")

    monkeypatch.setattr(multirun, "shared_superlink", _Link)
    with multirun.sweep_services(["seed=0,1"]) as extra:
        assert extra == {SHARED_SUPERLINK_VAR: "x"} and started == [None]
    assert started == [None, "stopped"]


def test_the_serverapp_of_a_shared_superlink_enters_the_jobs_locked_directory_and_no_one_else(tmp_path):
    with RunLock(tmp_path, "job-tag", guests=("link-tag",)):
        assert RunLock(tmp_path, "link-tag").acquire().fd is None  # let in, without a lock of its own
        assert RunLock(tmp_path, "job-tag").acquire().fd is None
        for other in ("other-tag", None):
            with pytest.raises(RunDirectoryBusy):
                RunLock(tmp_path, other).acquire()


def _tagged(tmp_path, name, tag):
    script = tmp_path / name
    script.write_text("import time\ntime.sleep(120)\n")
    return subprocess.Popen([sys.executable, str(script)], env={**os.environ, TAG_VAR: tag}, start_new_session=True)


def _guard(tmp_path, tag):
    """A process whose command line is the SuperLink guard's (``python -m <GUARD_MODULE> ...``): a stand-in
    package first on its path, so that the module sleeps."""
    root = tmp_path / "guard"
    module = root.joinpath(*GUARD_MODULE.split("."))
    for package in [root.joinpath(*GUARD_MODULE.split(".")[:i]) for i in range(1, GUARD_MODULE.count(".") + 1)]:
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").touch()
    module.with_suffix(".py").write_text("import time\ntime.sleep(120)\n")
    env = {**os.environ, TAG_VAR: tag, "PYTHONPATH": str(root)}
    args = [sys.executable, "-m", GUARD_MODULE, "--helper-wait", "90"]
    return subprocess.Popen(args, env=env, start_new_session=True)


def test_a_job_stops_what_is_left_of_its_run_and_spares_the_superlink(tmp_path):
    tag = new_tag()
    link, exe = _tagged(tmp_path, "flower-superlink", tag), _tagged(tmp_path, "flower-superexec", tag)
    guard = _guard(tmp_path, tag)  # the SuperLink runs under it: stopping it would stop the sweep's SuperLink
    run = [_tagged(tmp_path, "flwr-simulation", tag), _tagged(tmp_path, "raylet", tag)]
    try:
        time.sleep(0.5)  # each process's command line is readable
        assert set(shared_superlink.run_pids(tag)) == {p.pid for p in run}
        t0 = time.monotonic()
        stopped = shared_superlink.end_run(tag, settle=0.5)
        assert set(stopped) == {p.pid for p in run} and time.monotonic() - t0 < 10
        for proc in run:
            assert proc.wait(timeout=10) is not None
        assert link.poll() is None and exe.poll() is None and guard.poll() is None
        assert command_name(guard.pid) == GUARD_MODULE
        assert shared_superlink.run_pids(tag) == []
    finally:
        for proc in (link, exe, guard, *run):
            proc.kill()
            proc.wait()
