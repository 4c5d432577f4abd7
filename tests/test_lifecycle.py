"""Interrupts, kills and resumes through the README's commands and real processes: ``fedhm run``,
``fedhm resume``, ``fedhm sweep`` (and ``fedhm status``), each started in a session of its own as a
terminal starts a foreground job, and signalled as a terminal signals it (Ctrl-C: SIGINT to the
process group) or outright (SIGKILL):

* one run, signalled twice (one start-up and one resume saved; each step is what a user meets):
  while it trains, a second launch into its directory is refused (exit 2, naming the directory
  and the live PID); SIGKILL to ``fedhm run`` after round 3 of 7: the watchdog stops everything
  (within 10 s no process of the run is alive, checked by PID: every process carrying the run's
  tag in ``/proc/<pid>/environ`` and every descendant of the command, collected while the run
  trains, plus a last scan), ``fedhm status`` says the run stopped (exit 1); ``fedhm resume``
  goes on from the checkpoint's round; Ctrl-C to that resume a round later: exit 130, no
  traceback, nothing left within 10 s; the printed ``fedhm resume <run dir>`` finishes the run
  (its console's last progress line, ``fedhm status``: completed) with exactly the model of an
  uninterrupted run with the same seed (max abs diff 0; that run in process, on the in-process
  grid: the same ServerApp ``run`` and client handlers, the numbers of an uninterrupted
  ``fedhm run`` of the job without its start-up, see tests/inprocess_helpers.py);
* Ctrl-C to a 2-job ``fedhm sweep`` in its second job: exit 130, the report names the finished
  and the interrupted job, and its continue command runs only the missing rounds of the second
  job; the sweep summary then covers both. Its jobs inject a client crash (a real exception in
  the ClientApp): the console names it within 10 s of the round that saw it.

The process scans here (and in tests/lifecycle_helpers.py) are written independently of
``fedhm_flwr.ops.job.procs``. The parts (run lock, watchdog, refusals, error scan) are in
tests/test_lifecycle_parts.py.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from inprocess_helpers import run_in_process
from lifecycle_helpers import ROOT, descendants, fedhm_status, is_alive, process_state
from safetensors.torch import load_file

from fedhm_flwr.client import handlers
from fedhm_flwr.config import load_config
from fedhm_flwr.reporting.results import load_checkpoint_state

# 7 short rounds: Ray's start-up, then about a second per round; a checkpoint every round (the default)
# every client sleeps 3 s before it trains (seeded failure injection, numerics untouched): a round
# takes at least that long on any machine, so a SIGKILL after round 3 and a Ctrl-C to the resume a
# round later both land before round 7
ROUNDS = 7
JOB = [
    "failures.slow_probability=1.0",
    "failures.slow_seconds=3",
    f"rounds={ROUNDS}",
    "num_clients=2",
    "fraction_train=1.0",
    "dataset.max_train_examples=3000",
    "dataset.max_test_examples=300",
    "model.width=4",
    "evaluation.levels=false",
]
MODEL = Path("checkpoint") / "global_model.safetensors"


def _fedhm(run_dir: Path, *args: str, name: str = "run") -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``fedhm ARGS`` as a terminal starts it: a session (and process group) of its own; stdout
    and stderr to files next to the run directory. Returns (process, stdout file, stderr file)."""
    out, err = run_dir.parent / f"{run_dir.name}-{name}.out", run_dir.parent / f"{run_dir.name}-{name}.err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedhm_flwr", *args],
            cwd=ROOT,
            stdout=o,
            stderr=e,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return proc, out, err


def _ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


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


def _wait_for_round(
    run_dir: Path, proc: subprocess.Popen[bytes], log: Path, rounds: int = 1, timeout: float = 300, done=_rounds_logged
) -> None:
    deadline = time.monotonic() + timeout
    while done(run_dir) < rounds:
        assert proc.poll() is None, f"launcher exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no round {rounds} after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _with_env(needle: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                pass
    return {p for p in found if is_alive(p)}


def _run_tag(run_dir: Path) -> str:
    return json.loads((run_dir / ".lock").read_text())["tag"]


def _processes_of_the_run(run_dir: Path, launcher: int) -> set[int]:
    tag = f"FEDHM_RUN_TAG={_run_tag(run_dir)}"
    pids = _with_env(tag) | descendants(launcher)
    assert len(pids) >= 6, pids  # watchdog, SuperLink, SuperExec, flwr-simulation, flwr run, Ray, ...
    return pids


def _assert_all_gone(pids: set[int], run_dir: Path, since: float, limit: float = 10.0) -> None:
    tag = f"FEDHM_RUN_TAG={_run_tag(run_dir)}"
    while True:
        alive = {p for p in pids if is_alive(p)} | _with_env(tag)
        if not alive:
            return
        if time.monotonic() - since > limit:
            names = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in alive if process_state(p)}
            for p in alive:  # leave nothing behind for the next test
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            pytest.fail(f"{len(alive)} process(es) of the run alive {limit:.0f} s after the signal: {names}")
        time.sleep(0.2)


def _same_model(a: Path, b: Path) -> None:
    x, y = load_file(str(a / MODEL)), load_file(str(b / MODEL))
    assert x.keys() == y.keys()
    assert max(float((x[k].double() - y[k].double()).abs().max()) for k in x) == 0.0


# --------------------------------------------------------------------------- slow: whole runs


def _reference(run_dir: Path) -> Path:
    """The uninterrupted run of JOB with the same seed, in process, into ``run_dir``
    (tests/inprocess_helpers.py: the numbers of an uninterrupted ``fedhm run`` of JOB, without
    Flower's start-up). The injected 3 s sleeps are skipped (the clients answer one after another
    here: 42 s of sleeping; the numerics do not depend on them)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(handlers, "time", SimpleNamespace(sleep=lambda seconds: None))
        summary = run_in_process(load_config(JOB), run_dir)
    assert summary["rounds_completed"] == ROUNDS
    return run_dir


def _interrupt_after_round(
    run_dir: Path, proc: subprocess.Popen[bytes], err: Path, rounds: int, sig: signal.Signals | None
) -> int:
    """Wait for the run's checkpoint of ``rounds``, then Ctrl-C (``sig`` None) or ``sig`` to the
    command; check that no process of the run is alive 10 s later; the checkpoint's round."""
    _wait_for_round(run_dir, proc, err, rounds, timeout=900, done=_checkpoint_round)
    pids = _processes_of_the_run(run_dir, proc.pid)
    t0 = time.monotonic()
    if sig is None:
        _ctrl_c(proc)
    else:
        proc.send_signal(sig)
    _assert_all_gone(pids, run_dir, t0)
    proc.wait(timeout=10)
    saved = int(load_checkpoint_state(run_dir)["round"])
    assert rounds <= saved < ROUNDS, f"the signal did not reach the run in mid-course (checkpoint of round {saved})"
    return saved


@pytest.mark.slow
def test_fedhm_run_refuses_a_second_launch_survives_a_sigkill_and_a_ctrl_c_and_ends_as_an_uninterrupted_run(tmp_path):
    """The SIGKILL test and the Ctrl-C test on one run (they paid the same start-up and resume)."""
    run_dir = tmp_path / "run"
    proc, out, err = _fedhm(run_dir, "run", *JOB, "--run-dir", str(run_dir))
    reference = _reference(tmp_path / "reference")  # while the run starts up (~20 s)
    _wait_for_round(run_dir, proc, err, 1, timeout=900, done=_checkpoint_round)
    # a second launch into the live run's directory (a new run, a resume) is refused at once (both
    # started together: they take a round or two of the run)
    lock = (run_dir / ".lock").read_text()
    others = [
        subprocess.Popen(
            [sys.executable, "-m", "fedhm_flwr", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in (["run", *JOB, "--run-dir", str(run_dir)], ["resume", str(run_dir)])
    ]
    for other in others:
        stdout, stderr = other.communicate(timeout=300)
        assert other.returncode == 2, stdout + stderr
        (line,) = stderr.strip().splitlines()  # one line
        assert str(run_dir) in line and f"PID {proc.pid}" in line, line
    assert proc.poll() is None and (run_dir / ".lock").read_text() == lock

    # SIGKILL: the watchdog stops everything, `fedhm status` says so, `fedhm resume` goes on from its checkpoint
    killed = _interrupt_after_round(run_dir, proc, err, max(3, _checkpoint_round(run_dir) + 1), signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    before = (run_dir / "metrics.jsonl").read_text().splitlines()[:killed]
    status = fedhm_status(run_dir)
    assert (
        status.returncode == 1 and "stopped" in status.stderr and f"last checkpoint: round {killed}" in status.stderr
    ), status.stdout + status.stderr
    resumed, out, err = _fedhm(run_dir, "resume", str(run_dir), name="resume")

    # Ctrl-C to the resumed run a round later: exit 130, no traceback, nothing left, the resume command printed
    saved = _interrupt_after_round(run_dir, resumed, err, killed + 1, None)
    progress = [line for line in out.read_text().splitlines() if line.startswith("round ")]
    assert progress[0].startswith(f"round {killed + 1}/{ROUNDS} "), progress  # went on after the checkpoint's round
    stderr = err.read_text()
    assert resumed.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    match = re.search(r"round (\d+)\) is in .*; resume the run with:\n  (.+)\n", stderr)
    assert match and int(match.group(1)) == saved, stderr
    command = match.group(2)
    assert re.fullmatch(rf"\S*fedhm resume {re.escape(str(run_dir))}", command), command
    # exactly the printed command: it ends as the uninterrupted run ended
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=900, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run complete" in done.stdout
    assert f"round {ROUNDS}/{ROUNDS} " in done.stdout  # the launcher's progress line of the last round
    assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == ROUNDS
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert rows[:killed] == before and [json.loads(r)["round"] for r in rows] == list(range(1, ROUNDS + 1))
    _same_model(run_dir, reference)
    status = fedhm_status(run_dir)
    assert status.returncode == 0 and f"completed ({ROUNDS}/{ROUNDS} rounds)" in status.stdout, (
        status.stdout + status.stderr
    )


def _timed_lines(path: Path, proc: subprocess.Popen[bytes], stamps: dict[str, float]) -> threading.Thread:
    """Note when each line first appears in ``path`` (the command's console) while ``proc`` runs."""

    def follow() -> None:
        while True:
            running = proc.poll() is None
            for line in path.read_text(errors="replace").splitlines():
                stamps.setdefault(line, time.monotonic())
            if not running:
                return
            time.sleep(0.1)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_ctrl_c_to_a_sweep_names_its_jobs_and_the_continue_command_runs_only_what_is_missing(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # every sampled client raises in its ClientApp (failure injection): a real client error
    args = [
        "seed=0,1",
        "rounds=4",
        *[o for o in JOB if not o.startswith("rounds=")],
        "failures.crash_probability=1.0",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc, out, err = _fedhm(sweep_dir, "sweep", *args)
    stamps: dict[str, float] = {}
    follower = _timed_lines(out, proc, stamps)
    job0, job1 = sweep_dir / "job0", sweep_dir / "job1"
    _wait_for_round(job1, proc, err, 2, timeout=1200, done=_checkpoint_round)
    t0 = time.monotonic()
    pids = _processes_of_the_run(job1, proc.pid)
    _ctrl_c(proc)
    _assert_all_gone(pids, job1, t0)
    assert proc.wait(timeout=10) == 130, err.read_text()[-3000:]
    follower.join(timeout=10)
    stderr = err.read_text()
    assert "Traceback" not in stderr, stderr
    assert "finished: job0; interrupted: job1; not started: 0" in stderr, stderr
    command = re.search(r"continue the sweep .*with:\n  (.+)\n", stderr).group(1)
    assert command.endswith(f"fedhm sweep --continue {sweep_dir}"), command
    # the client's own exception on the console, within 10 s of the round that saw it
    seen = [
        t
        for line, t in stamps.items()
        if line.startswith("job 0: first client error: round 1: node ")
        and line.endswith("failed: client error: fedhm_flwr.client.handlers.InjectedFailure: injected client crash")
    ]
    round_1 = [t for line, t in stamps.items() if line.startswith("job 0: round 1/4 ")]
    assert seen and round_1 and seen[0] - round_1[0] < 10, sorted(stamps)
    finished = {p: p.stat().st_mtime_ns for p in job0.iterdir() if p.is_file()}
    resumed_from = _checkpoint_round(job1)

    cont = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=1200, start_new_session=True)
    assert cont.returncode == 0, cont.stdout[-3000:] + cont.stderr[-3000:]
    assert "job 0: finished in an earlier session: kept" in cont.stdout
    assert {p: p.stat().st_mtime_ns for p in job0.iterdir() if p.is_file()} == finished  # job 0 not run again
    progress = [line for line in cont.stdout.splitlines() if line.startswith("job 1: round ")]
    assert progress[0].startswith(f"job 1: round {resumed_from + 1}/4 "), progress
    assert [json.loads(r)["round"] for r in (job1 / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    with (sweep_dir / "summary.csv").open() as fh:
        assert sorted(row["run"] for row in csv.DictReader(fh)) == ["job0", "job1"]
