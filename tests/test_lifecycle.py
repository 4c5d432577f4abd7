"""The launcher's lifecycle, through real processes: ``python -m fedhm_flwr.launch`` in its own
session, signalled while its run trains.

* SIGINT, SIGTERM, SIGKILL to the launcher: within 10 s no process of the run is alive (checked
  by PID: every process carrying the run's tag in ``/proc/<pid>/environ`` and every descendant
  of the launcher, collected while the run trains, plus a last scan);
* after SIGINT the launcher printed the resume command; running exactly that command exits 0
  and ends with the same global model as an uninterrupted run with the same seed;
* the resume of a run killed with SIGKILL goes on from its checkpoint, and the final resume exits 0
  (the launcher judges its own run id, not the other runs in the reused state database, among
  them the killed one that never finished); SIGKILL and SIGINT share one run (killed, resumed,
  interrupted, resumed) so that the whole suite stays within its time budget;
* a second launch into a live run's directory is refused at once (exit 2, naming the directory
  and the live PID) and writes nothing there.

The process scans here are written independently of ``fedhm_flwr.procs``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fedhm_flwr.procs import RunDirectoryBusy, RunLock

ROOT = Path(__file__).resolve().parent.parent
# 12 short rounds: ~12 s of Ray start-up, then ~0.5 s per round; checkpoint every round
JOB = ["rounds=12", "num_clients=2", "fraction_train=1.0", "dataset.max_train_examples=3000",
       "dataset.max_test_examples=300", "model.width=4", "evaluation.levels=false", "checkpoint.every=1"]
MODEL = Path("checkpoint") / "global_model.safetensors"



def _launch(run_dir: Path, *args: str, name: str = "launcher") -> tuple[subprocess.Popen[bytes], Path]:
    """The launcher as a user starts it, in a session of its own; output to a file."""
    log = run_dir.parent / f"{run_dir.name}-{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fedhm_flwr.launch", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, log


def _rounds_logged(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _checkpoint_round(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "checkpoint" / "strategy_state.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return 0


def _wait_for_round(run_dir: Path, proc: subprocess.Popen[bytes], log: Path, rounds: int = 1,
                    timeout: float = 300, done=_rounds_logged) -> None:
    deadline = time.monotonic() + timeout
    while done(run_dir) < rounds:
        assert proc.poll() is None, f"launcher exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no round {rounds} after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _state(pid: int) -> str | None:
    """One-letter state of a process, None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _is_alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _with_env(needle: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                pass
    return {p for p in found if _is_alive(p)}


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _run_tag(run_dir: Path) -> str:
    return json.loads((run_dir / ".lock").read_text())["tag"]


def _processes_of_the_run(run_dir: Path, launcher: int) -> set[int]:
    tag = f"FEDHM_RUN_TAG={_run_tag(run_dir)}"
    pids = _with_env(tag) | _descendants(launcher)
    assert len(pids) >= 6, pids  # watchdog, SuperLink, SuperExec, flwr-simulation, flwr run, Ray, ...
    return pids


def _assert_all_gone(pids: set[int], run_dir: Path, since: float, limit: float = 10.0) -> None:
    tag = f"FEDHM_RUN_TAG={_run_tag(run_dir)}"
    while True:
        alive = {p for p in pids if _is_alive(p)} | _with_env(tag)
        if not alive:
            return
        if time.monotonic() - since > limit:
            names = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in alive if _state(p)}
            for p in alive:  # leave nothing behind for the next test
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            pytest.fail(f"{len(alive)} process(es) of the run alive {limit:.0f} s after the signal: {names}")
        time.sleep(0.2)


def _signal_mid_run(run_dir: Path, sig: signal.Signals, resume_after: int = 0
                    ) -> tuple[subprocess.Popen[bytes], Path, int]:
    """Start the job (or, with ``resume_after`` = the round of the checkpoint there, resume it),
    signal the launcher once its run checkpointed a round of its own, check that everything is gone
    in 10 s; returns (launcher, its log, round of the checkpoint left behind)."""
    if resume_after:
        proc, log = _launch(run_dir, "--resume", str(run_dir), name="resume")
    else:
        proc, log = _launch(run_dir, *JOB, "--run-dir", str(run_dir))
    _wait_for_round(run_dir, proc, log, resume_after + 1, done=_checkpoint_round)
    pids = _processes_of_the_run(run_dir, proc.pid)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _assert_all_gone(pids, run_dir, t0)
    proc.wait(timeout=10)
    saved = _checkpoint_round(run_dir)
    assert resume_after < saved < 12, f"the signal did not reach the run in mid-course (checkpoint of round {saved})"
    return proc, log, saved


def _same_model(a: Path, b: Path) -> None:
    x, y = load_file(str(a / MODEL)), load_file(str(b / MODEL))
    assert x.keys() == y.keys()
    assert max(float((x[k].double() - y[k].double()).abs().max()) for k in x) == 0.0


# --------------------------------------------------------------------------- fast: the parts


HOLDER = """
import sys, time
from fedhm_flwr.procs import RunLock
lock = RunLock(sys.argv[1], tag="job-1").acquire()
print("locked", flush=True)
time.sleep(300)
"""


def test_run_lock_refuses_a_live_holder_lets_its_own_job_in_and_ignores_a_dead_ones_file(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 2 ** 22 + 7, "tag": "old"}))  # left by a dead run
    RunLock(tmp_path).acquire().release()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
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
from fedhm_flwr.procs import Processes
procs = Processes()
own = procs.start("own", ["sleep", "300"], dict(os.environ), None)
# a child that leaves its session, and one in a tagged session whose environment lost the tag
shell = procs.start("shell", ["sh", "-c", "setsid sleep 301 & env -i /bin/sleep 302 & wait"], dict(os.environ), None)
print(procs.tag, procs.watchdog.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_stops_every_process_of_a_launcher_killed_outright(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    tag, watchdog = launcher.stdout.readline().split()
    deadline = time.monotonic() + 30
    pids: set[int] = set()
    while len(pids) < 5:  # the watchdog, sleep 300, sh, sleep 301 (own session), sleep 302 (no tag)
        assert time.monotonic() < deadline, pids
        time.sleep(0.1)
        pids = {p for p in _descendants(launcher.pid) if _is_alive(p)}
    assert int(watchdog) in pids
    assert f"FEDHM_RUN_TAG={tag}".encode() not in Path(f"/proc/{watchdog}/environ").read_bytes()  # not a target
    t0 = time.monotonic()
    launcher.kill()
    launcher.wait()
    while any(_is_alive(p) for p in pids):
        assert time.monotonic() - t0 < 10, {p: _state(p) for p in pids if _is_alive(p)}
        time.sleep(0.1)


def test_missing_cifar_fails_at_once_with_one_line_and_starts_nothing(tmp_path):
    """dataset=cifar10 with no CIFAR data: the real launcher exits 2 within seconds, one line
    naming dataset.data_dir / FEDHM_DATA_DIR, no run directory, no process (nothing tagged)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "FEDHM_DATA_DIR": str(empty)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fedhm_flwr.launch", "dataset=cifar10", f"dataset.data_dir={empty}",
                           "--run-dir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "dataset.data_dir" in line and "FEDHM_DATA_DIR" in line and "Traceback" not in proc.stderr
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- slow: whole runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run with the same seed."""
    run_dir = tmp_path_factory.mktemp("lifecycle") / "reference"
    proc, log = _launch(run_dir, *JOB, "--run-dir", str(run_dir))
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == 12
    assert "[round 12/12]" in log.read_text()  # the launcher shows Flower's round lines on its console
    return run_dir


@pytest.mark.slow
def test_sigkill_then_ctrl_c_leave_nothing_behind_and_the_printed_resume_finishes_the_same_model(tmp_path,
                                                                                                 reference):
    run_dir = tmp_path / "run"
    proc, _, killed_at = _signal_mid_run(run_dir, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    # the state database now holds a run that never finished; its resume goes on from the checkpoint
    # (a round of its own, past the killed run's) until Ctrl-C
    proc, log, saved = _signal_mid_run(run_dir, signal.SIGINT, resume_after=killed_at)
    out = log.read_text()
    assert proc.returncode == 130, out[-3000:]
    match = re.search(r"resume the run with:\n  (.+)\n", out)
    assert match, out[-3000:]
    command = match.group(1)
    assert f"--resume {run_dir}" in command and f"round {saved})" in out
    # exactly the printed command: it judges its own run, not the killed one, and ends as the
    # uninterrupted run ended
    resumed = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=600,
                             start_new_session=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "run complete" in resumed.stdout + resumed.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, 13))
    _same_model(run_dir, reference)


@pytest.mark.slow
def test_a_live_run_keeps_its_directory_and_sigterm_stops_it(tmp_path):
    run_dir = tmp_path / "run"
    long_job = ["rounds=200" if o.startswith("rounds=") else o for o in JOB]
    proc, log = _launch(run_dir, *long_job, "--run-dir", str(run_dir))
    _wait_for_round(run_dir, proc, log)
    pids = _processes_of_the_run(run_dir, proc.pid)
    files = [run_dir / ".lock", run_dir / ".flwr" / "run_config.toml", run_dir / ".flwr" / "app"]
    before = {f: f.stat().st_mtime_ns for f in files}
    lock = (run_dir / ".lock").read_text()
    t0 = time.monotonic()
    second = [subprocess.Popen([sys.executable, "-m", "fedhm_flwr.launch", *args], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for args in ([*JOB, "--run-dir", str(run_dir)], ["--resume", str(run_dir)])]
    for other in second:
        out, err = other.communicate(timeout=120)
        assert other.returncode == 2, out + err
        (line,) = err.strip().splitlines()  # one line
        assert str(run_dir) in line and f"PID {proc.pid}" in line, line
    took = time.monotonic() - t0
    assert proc.poll() is None, "the live run ended before the check"
    assert {f: f.stat().st_mtime_ns for f in files} == before and (run_dir / ".lock").read_text() == lock
    assert _with_env(f"FLWR_HOME={run_dir / '.flwr'}") <= pids | _with_env(f"FEDHM_RUN_TAG={_run_tag(run_dir)}")

    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _assert_all_gone(pids, run_dir, t0)
    assert proc.wait(timeout=10) == 143
    assert "resume the run with:" in log.read_text()
    print(f"second launches refused in {took:.1f} s")
