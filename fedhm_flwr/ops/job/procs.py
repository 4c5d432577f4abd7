"""The processes of one job: start them tagged, stop them all, also when the launcher dies.

Shared by ``fedhm_flwr.ops.job.launch`` (simulation) and ``fedhm deploy-local`` (deployment):

* every process a job starts runs in its own session and carries ``FEDHM_RUN_TAG=<tag>`` in its
  environment; whatever it starts in turn (Flower's SuperExec, ``flwr-simulation``, Ray's
  ``gcs_server``, ``raylet`` and workers) inherits the tag, also when it leaves the session, so
  a scan of ``/proc/*/environ`` finds all of them (:func:`tagged_pids`);
* :class:`Processes` starts and stops them (by process group, then by tag);
* a **watchdog** (:func:`start_watchdog`, ``python -m fedhm_flwr.ops.job.procs --watch TAG``) is a tiny
  process in a session of its own that ignores SIGINT, SIGTERM and SIGHUP and blocks reading a
  pipe whose write end only the launcher holds. When the launcher dies, even by SIGKILL, the
  pipe closes and the watchdog stops every tagged process, then exits;
* :func:`~fedhm_flwr.ops.job.signals.on_signals` turns SIGINT / SIGTERM / SIGHUP into one
  :class:`~fedhm_flwr.ops.job.signals.Interrupted` exception, so cleanup runs; a second signal during
  the cleanup only prints that the cleanup goes on (:mod:`fedhm_flwr.ops.job.signals`);
* the run directory's lock is :mod:`fedhm_flwr.ops.job.runlock`.

The tag scan needs Linux's ``/proc`` (what CI runs). Where there is none (macOS), the fallback is
process groups: every process is started as the leader of its own group, :class:`Processes`
tells the watchdog each group id, and the watchdog signals those groups. Processes that leave
their group (Flower's SuperExec starts its own session) are then out of reach of the watchdog.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

# re-exported for the CLI (fedhm_flwr/ops/cli.py), which imports them from here
from fedhm_flwr.ops.job.signals import Interrupted as Interrupted, on_signals as on_signals

TAG_VAR = "FEDHM_RUN_TAG"  # environment variable marking every process of one job
HAVE_PROC = Path("/proc/self/environ").exists()


def new_tag() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- finding processes


def is_zombie(pid: int) -> bool:
    """True for an exited process not yet reaped (or one that is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return HAVE_PROC
    return stat[stat.rfind(")") + 2 :].startswith(("Z", "X"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)


_SESSIONS: dict[str, set[int]] = {}  # tag -> sessions its processes were seen in


def stat_field(pid: int, index: int) -> int | None:
    """Field ``index`` of ``/proc/<pid>/stat`` after the name (1: parent, 3: session); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rfind(")") + 2 :].split()[index])
    except (OSError, IndexError, ValueError):
        return None


def tagged_pids(tag: str, spare: Sequence[str] = ()) -> list[int]:
    """Live processes of the job ``tag`` (Linux ``/proc``; else []): those whose environment carries
    ``FEDHM_RUN_TAG=<tag>``, and every process in a session one of them was seen in; but those running a
    command named in ``spare`` (:func:`command_name`).

    The sessions matter because a process may overwrite its environment block: Ray's agents and
    workers set their process title (``ray::DashboardAgent``) over it. Every session a tagged
    process is in was created by the job (each process is started with a session of its own,
    Flower's SuperExec makes its own), so its members belong to the job too."""
    needle = f"{TAG_VAR}={tag}".encode()
    sessions = _SESSIONS.setdefault(tag, set())
    if not HAVE_PROC:
        return []
    me = os.getpid()
    others: dict[int, int | None] = {}
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        if is_zombie(pid):
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        sid = stat_field(pid, 3)
        if needle in environ.split(b"\0"):
            found.add(pid)
            if sid is not None and sid != stat_field(me, 3):
                sessions.add(sid)
        else:
            others[pid] = sid
    found |= {pid for pid, sid in others.items() if sid in sessions}
    return sorted(pid for pid in found if not spare or command_name(pid) not in spare)


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


#: the processes that host the ServerApp (simulation, deployment)
SERVERAPP_COMMANDS = ("flwr-simulation", "flwr-serverapp")


def command_name(pid: int) -> str:
    """The program a process runs: ``flwr-simulation`` for ``python .../bin/flwr-simulation ...``, the
    module for ``python -m module ...`` (``fedhm_flwr.ops.deploy.link_guard``: the SuperLink's guard)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    names = [Path(a.decode(errors="replace")).name for a in argv[:2] if a]
    if len(names) == 2 and names[0].startswith("python"):
        if names[1] == "-m" and len(argv) > 2:
            return argv[2].decode(errors="replace")
        return names[1]
    return names[0] if names else ""


def kill_serverapp(tag: str, timeout: float = 3.0) -> list[int]:
    """SIGKILL the tagged processes that host the ServerApp, first and at once.

    A run being torn down must not go on recording: were its clients (Ray workers, SuperNodes)
    stopped first, the ServerApp would count them as failures and checkpoint a round that never
    really happened. Killed outright, it keeps its last checkpoint (written atomically)."""
    pids = [p for p in tagged_pids(tag) if command_name(p) in SERVERAPP_COMMANDS]
    _signal_all(pids, signal.SIGKILL)
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return pids


def _ray_worker(pid: int) -> bool:
    """Ray's agents and workers (titled ``ray::DashboardAgent``, ``ray::ClientAppActor``): they outlive
    their raylet for seconds and take SIGTERM slowly, and keep nothing, so a cleanup neither waits for
    them nor gives them a grace period."""
    return command_name(pid).startswith("ray::")


def kill_tagged(
    tag: str, grace: float = 3.0, settle: float = 0.0, limit: float = 30.0, spare: Sequence[str] = ()
) -> list[int]:
    """Stop every tagged process: the ServerApp first (:func:`kill_serverapp`), then SIGTERM to
    the rest and SIGKILL to each one still there ``grace`` s later; returns what was found.

    ``settle`` > 0 first waits up to that long for tagged processes to exit on their own (a
    detached SuperExec notices its SuperLink is gone). Scans until none is left (a dying tree
    can still spawn: Ray restarts workers), for at most ``limit`` s. Processes running a command named
    in ``spare`` are left alone (a sweep's shared SuperLink, :mod:`fedhm_flwr.ops.sweeps.shared_superlink`)."""
    found = kill_serverapp(tag)
    end = time.monotonic() + settle
    pids = tagged_pids(tag, spare)
    while any(not _ray_worker(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
        pids = tagged_pids(tag, spare)
    termed: dict[int, float] = {}
    end = time.monotonic() + limit
    while pids and time.monotonic() < end:
        now = time.monotonic()
        for pid in pids:
            if pid not in termed:
                _signal_all([pid], signal.SIGKILL if _ray_worker(pid) else signal.SIGTERM)
                termed[pid] = now
            elif now - termed[pid] > grace:
                _signal_all([pid], signal.SIGKILL)
        time.sleep(0.1)
        pids = tagged_pids(tag, spare)
    return sorted({*found, *termed})


def killpg_quietly(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# --------------------------------------------------------------------------- the watchdog


def start_watchdog(tag: str, keep_fds: Sequence[int] = ()) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """Start the watchdog of ``tag``; returns (its process, the pipe's write end).

    Only this process holds the write end (it is not inherited by anything else started here).
    ``keep_fds`` are handed to the watchdog too (the run lock: held until the cleanup is done)."""
    read, write = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != TAG_VAR}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedhm_flwr.ops.job.procs", "--watch", tag],
            stdin=read,
            stdout=subprocess.DEVNULL,
            pass_fds=tuple(keep_fds),
            env=env,
            cwd=str(Path(__file__).resolve().parents[3]),
            start_new_session=True,
        )
    finally:
        os.close(read)
    return proc, os.fdopen(write, "wb", buffering=0)


def watch(tag: str, pipe: IO[bytes]) -> int:
    """The watchdog's loop: learn process groups from the pipe; at end of file stop everything."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    groups: list[int] = []
    for line in pipe:  # returns at end of file: the launcher closed the pipe or died
        word, _, value = line.decode(errors="replace").partition(" ")
        if word == "pgid" and value.strip().isdigit():
            groups.append(int(value))
    if HAVE_PROC:
        t0 = time.monotonic()
        stopped = kill_tagged(tag, grace=1.0)
        left = tagged_pids(tag)
        if stopped or left:  # the launcher did not stop them: it died (its console may be gone too)
            with contextlib.suppress(OSError):
                print(
                    f"[fedhm watchdog] the launcher is gone: stopped {len(stopped)} process(es) of its run in "
                    f"{time.monotonic() - t0:.1f} s" + (f"; still running: {left}" if left else ""),
                    file=sys.stderr,
                    flush=True,
                )
    else:  # no /proc (macOS): the process groups the launcher announced
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0)):
            for pgid in groups:
                killpg_quietly(pgid, sig)
            time.sleep(wait)
    return 0


# --------------------------------------------------------------------------- starting and stopping


class Processes:
    """The processes of one job: each in its own session, all tagged, watched by a watchdog.

    Use as a context manager: leaving it stops everything that was started (and the watchdog)."""

    def __init__(
        self,
        tag: str | None = None,
        watchdog: bool = True,
        keep_fds: Sequence[int] = (),
        grace: float = 5.0,
        settle: float = 1.0,
    ) -> None:
        self.tag = tag or new_tag()
        self.grace, self.settle = grace, settle
        self.started: list[tuple[str, subprocess.Popen[bytes], Any]] = []
        self.watchdog: subprocess.Popen[bytes] | None = None
        self._pipe: IO[bytes] | None = None
        if watchdog:
            self.watchdog, self._pipe = start_watchdog(self.tag, keep_fds)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this environment) with the job's tag."""
        return {**(os.environ if base is None else base), TAG_VAR: self.tag}

    def start(
        self, name: str, cmd: list[str], env: dict[str, str], log_file: Path | None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` tagged, in its own session; output to ``log_file`` (None: a pipe)."""
        handle = None
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            handle = log_file.open("ab")
        proc = subprocess.Popen(
            cmd,
            env=self.env(env),
            stdout=handle or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
        self.started.append((name, proc, handle))
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                self._pipe.write(f"pgid {proc.pid}\n".encode())
        return proc

    def run(
        self, cmd: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command tagged, in its own session; killed (with its group) after ``timeout`` s."""
        proc = subprocess.Popen(
            cmd,
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            killpg_quietly(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    @staticmethod
    def stop_groups(procs: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
        """SIGTERM the processes' groups together; SIGKILL what is left after ``grace`` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for proc in procs:
                if proc.poll() is None:
                    killpg_quietly(proc.pid, sig)
            deadline = time.monotonic() + wait
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if all(proc.poll() is not None for proc in procs):
                break
        for proc in procs:  # members of a group that outlived their leader
            killpg_quietly(proc.pid, signal.SIGKILL)

    def stop_all(
        self, grace: float = 10.0, last: Sequence[str] = ("superlink",), settle: float | None = None
    ) -> list[int]:
        """Stop everything: the processes not named in ``last`` first, then those in ``last``, then
        every tagged process that left its group (a detached SuperExec, Ray).

        Returns the PIDs the final tag scan found and stopped. ``settle`` (default ``grace``)
        is how long the scan waits for such processes to exit on their own first."""
        kill_serverapp(self.tag)  # before its clients go (see there)
        first = [proc for name, proc, _ in self.started if name not in last]
        final = [proc for name, proc, _ in self.started if name in last]
        for wave in (first, final):
            if wave:
                self.stop_groups(wave, grace)
        for _, proc, handle in self.started:
            if handle is not None:
                handle.close()
            if proc.stdout is not None:
                proc.stdout.close()
        self.started.clear()
        return kill_tagged(self.tag, grace=min(grace, 3.0), settle=grace if settle is None else settle)

    def close(self, grace: float = 10.0, settle: float | None = None) -> list[int]:
        """Stop everything, then let the watchdog go (it checks once more and exits)."""
        leftovers = self.stop_all(grace, settle=settle)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        if self.watchdog is not None:
            try:
                self.watchdog.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
                self.watchdog.wait()
            self.watchdog = None
        return leftovers

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(self.grace, self.settle)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--watch":
        sys.exit(watch(sys.argv[2], sys.stdin.buffer))
    sys.exit(
        "usage: python -m fedhm_flwr.ops.job.procs --watch TAG  (started by the launcher; reads its pipe on stdin)"
    )
