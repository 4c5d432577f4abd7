"""``fedhm supernode ARGS``: ``flower-supernode ARGS`` that keeps a device running.

Every argument but the wrapper's own goes to ``flower-supernode``, its output passed through. What the
wrapper adds (Flower 1.42), and why:

* **It comes back.** A SuperNode that ends unasked (``kill -9``, the OOM killer, a crash) is started
  again after a line that says why (exit code or signal, its last line), with a back-off: 1, 2, 4 ...
  60 s, from 1 s again after a 5-minute run. Not one that Flower ends with an error code of its own
  (``Exit Code: 3xx``: a bad certificate, key or address, a TLS failure): a restart cannot fix that,
  so the wrapper exits with its status (docs/DEPLOY.md's systemd unit tries again a minute later).
* **A refused activation.** A killed SuperNode cannot say goodbye: the SuperLink keeps its session
  ``online`` until its heartbeats lapse (``HEARTBEAT_PATIENCE`` × ``HEARTBEAT_DEFAULT_INTERVAL``,
  2 × 30 s) and refuses it inside that window (``[code: 2004] Failed to activate SuperNode``, Flower's
  exit code 305, status 1). The wrapper waits the window out plus 5 s (a round waiting on the old
  session then records ``node unavailable``) and starts it once more; refused again, it gives up
  (an unregistered key is refused the same way).
* **What the SuperNode started ends with it.** ``flower-superexec`` and the ``flwr-clientapp`` it starts
  per message watch only their own parent (``--parent-pid``: blind to one gone but not reaped); a
  busy ClientApp was seen running on for minutes after its SuperNode (~150 MB, re-parented to init).
  Every process of a SuperNode start inherits a tag in its environment (``FEDHM_SUPERNODE_TAG``):
  once the SuperNode has exited, all are ended (SIGTERM, SIGKILL 3 s later), before any restart.
* **ClientApps of a SuperLink that is gone.** While ClientApps run, the SuperLink's port is probed (a
  TCP connection every 10 s, every 2 s after a miss). Refused for 10 s: the SuperLink process is down
  and its ServerApps with it (a resumed run is a new run); no answer for the heartbeat window: it
  has marked this node offline and failed its messages. Either way their work is lost, and the
  SuperNode is started afresh, its ClientApps ended. No probe where an HTTPS proxy is set for that
  host (the SuperNode's path would differ).
* **A start that never connects** is stopped, and the wrapper exits 1 (systemd's ``Restart=`` starts it later):
  one whose start failed (a traceback before it connected, e.g. ``flower-superexec`` not on ``PATH``: its
  Runtime API server keeps the process up), or one not activated ``--connect-timeout`` s after its start
  while the SuperLink's port answers. The SuperNode gets this environment's ``bin`` first on ``PATH``.
* **Stopping.** SIGTERM / SIGINT / SIGHUP: the SuperNode gets SIGTERM (its clean stop; SIGKILL after
  15 s) unless the signal reached it too (Ctrl-C, a signal to the process group), then all its
  processes are ended; exit 0.

Linux (``/proc``). Standard library only, so that it starts at once: nothing of the app or of
Flower is imported (tests check its constants against Flower's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from fedhm_flwr.ops.deploy.link_watch import (
    HEARTBEAT_WINDOW,
    PROBE_EVERY,
    LinkWatch,
    behind_proxy,
    probe,
    superlink_address,
)
from fedhm_flwr.ops.deploy.node_output import ACTIVATION_FAILED, LEAVING, Ended, Quiet, hint

__all__ = ["ACTIVATION_FAILED", "LEAVING", "Ended", "Supervisor", "main", "supervise"]

#: the wait after the window: a round's pull loop must see the old session gone before it is back
MARGIN = 5.0
TAG_VAR = "FEDHM_SUPERNODE_TAG"  # marks every process of one SuperNode start

BACKOFF_CAP = 60.0  # the longest wait before a restart
HEALTHY_RUN = 300.0  # a start that ran this long resets the back-off
KILL_GRACE = 3.0  # SIGTERM, then SIGKILL this much later (the SuperNode's processes)
STOP_GRACE = 15.0  # the SuperNode's own clean stop (Flower forces its exit after 5 s)
FORWARD_AFTER = 1.0  # a stop signal goes on to a SuperNode not leaving by itself this much later
CONNECT_TIMEOUT = 120.0  # a SuperNode not activated this long while its SuperLink answers is stopped for good
CRASH_GRACE = 3.0  # a start that printed a traceback and has not connected this much later: it failed
LINK_UP_FOR = 45.0  # ... and one whose SuperLink's port answered this long (Flower retries every <= 20 s)


def _say(message: str) -> None:
    print(f"[fedhm supernode] {message}", file=sys.stderr, flush=True)


def flower_supernode() -> str:
    """``flower-supernode`` of this Python environment (also without an activated venv)."""
    candidate = Path(sys.executable).parent / "flower-supernode"
    return str(candidate) if candidate.exists() else (shutil.which("flower-supernode") or "flower-supernode")


def backoff(failures: int) -> float:
    """The wait before restart number ``failures`` (1, 2, ...) of a row of quick deaths: 1, 2, 4 ... ≤ 60 s."""
    return min(BACKOFF_CAP, 2.0 ** (max(failures, 1) - 1))


def exit_status(code: int) -> str:
    """``exit code 1`` / ``killed by SIGKILL`` (a Popen return code)."""
    names = {-s.value: s.name for s in signal.Signals}
    return f"exit code {code}" if code >= 0 else f"killed by {names.get(code, f'signal {-code}')}"


# --------------------------------------------------------------------------- processes (/proc)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*")]


def _proc(pid: int, name: str) -> list[bytes]:
    """``/proc/<pid>/<name>`` (``cmdline``, ``environ``) split at its NULs; [] when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().split(b"\0")
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that does not reap it)."""
    stat = b"".join(_proc(pid, "stat"))
    return bool(stat) and stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def program(pid: int) -> str:
    """The program a process runs: ``flwr-clientapp`` also for ``python .../bin/flwr-clientapp ...``."""
    names = [os.path.basename(a.decode(errors="replace")) for a in _proc(pid, "cmdline")[:2] if a]
    if len(names) == 2 and names[0].startswith("python") and not names[1].startswith("-"):
        return names[1]
    return names[0] if names else ""


def children(pid: int) -> list[int]:
    """Processes started with ``--parent-pid <pid>`` (by a SuperNode: its SuperExec; by that: its ClientApps)."""
    pair = (b"--parent-pid", str(pid).encode())
    return [p for p in _pids() if pair in zip(_proc(p, "cmdline"), _proc(p, "cmdline")[1:])]


def marked(tag: str) -> list[int]:
    """Live processes whose environment carries ``FEDHM_SUPERNODE_TAG=<tag>``: a SuperNode start and
    everything it started, wherever they were re-parented."""
    needle = f"{TAG_VAR}={tag}".encode()
    return [p for p in _pids() if p != os.getpid() and needle in _proc(p, "environ") and alive(p)]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def stop(pids: list[int], grace: float | None = None) -> None:
    """SIGTERM these processes, SIGKILL those still there after ``grace`` seconds (default :data:`KILL_GRACE`)."""
    _signal(pids, signal.SIGTERM)
    end = time.monotonic() + (KILL_GRACE if grace is None else grace)
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    _signal([p for p in pids if alive(p)], signal.SIGKILL)


def _named(pids: list[int]) -> str:
    return ", ".join(f"{program(p) or '?'} {p}" for p in pids)


# --------------------------------------------------------------------------- one SuperNode start


class Supervisor:
    """Runs ``command`` (``flower-supernode ...``) again and again: :meth:`run`."""

    def __init__(
        self,
        command: list[str],
        refused_wait: float = HEARTBEAT_WINDOW + MARGIN,
        sleep: Callable[[float], object] | None = None,
        watch: Callable[[], LinkWatch] = LinkWatch,
        probe_every: tuple[float, float] = PROBE_EVERY,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.command, self.refused_wait, self.watch, self.probe_every = command, refused_wait, watch, probe_every
        self.connect_timeout = connect_timeout
        self.stopping = threading.Event()
        self.sigterm_at: float | None = None  # when the SuperNode is due a SIGTERM (unless it is leaving)
        self.sleep = sleep or self.stopping.wait  # a stop cuts a wait short
        self.address = superlink_address(command[1:])
        if self.address is not None and behind_proxy(self.address[0]):
            _say(f"an HTTPS proxy is set for {self.address[0]}: the SuperLink is not probed")
            self.address = None

    def on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping.is_set():  # the SuperNode gets SIGTERM from _wait
            self.sigterm_at = time.monotonic() + FORWARD_AFTER
            self.stopping.set()
            _say(f"{signal.Signals(signum).name} received: stopping the SuperNode and what it started")

    def run(self) -> int:
        """Start the SuperNode until it is stopped or cannot come back; 0 after a stop, else its last status."""
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _loop(self) -> int:
        failures, refused_before = 0, False
        while not self.stopping.is_set():
            ended = self.start()
            if self.stopping.is_set() or ended.afresh:  # a stop ends the loop; a fresh start follows at once
                continue
            if ended.stuck:  # said when it was stopped
                return 1
            if ended.refused and (refused_before or self.refused_wait <= 0):
                if refused_before:
                    _say(
                        f"still refused after {self.refused_wait:g} s: the key is not registered with this "
                        "SuperLink, or belongs to another node (`flwr supernode ls`, `flwr supernode register`)"
                    )
                return ended.code
            if ended.refused:
                refused_before, delay = True, self.refused_wait
                _say(
                    f"the SuperLink refused to activate this node ({ACTIVATION_FAILED}): its key is not registered "
                    "with this SuperLink (`flwr supernode ls`, `flwr supernode register`), or this node was killed "
                    "less than a heartbeat window ago and the SuperLink still holds its old session (it lapses "
                    f"{HEARTBEAT_WINDOW:g} s after the last heartbeat); starting it once more in {delay:g} s "
                    "to tell the two apart"
                )
            elif ended.flower_code is not None:
                _say(
                    f"flower-supernode ended with Flower's exit code {ended.flower_code} ({exit_status(ended.code)}): "
                    "a restart cannot fix that; see its lines above"
                )
                return ended.code
            else:
                refused_before = False
                failures = 1 if ended.seconds >= HEALTHY_RUN else failures + 1
                delay = backoff(failures)
                _say(
                    f"flower-supernode {exit_status(ended.code)} after {ended.seconds:.0f} s (its last line: "
                    f"{ended.last_line or 'none'}); starting it again in {delay:g} s"
                )
            self.sleep(delay)
        return 0

    def start(self) -> Ended:
        """One start of the SuperNode, its output passed through, until it exits (also when :meth:`_watch_link`
        stops it); then every process it started is ended."""
        tag, t0, ended, done = uuid.uuid4().hex, time.monotonic(), Ended(), threading.Event()
        self.sigterm_at = time.monotonic() if self.stopping.is_set() else None  # a stop during the start
        proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=supernode_env(tag))
        quiet = Quiet()

        def pass_through() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                ended.read(raw)
                try:
                    for line in quiet.feed(raw, ended.leaving):
                        sys.stdout.buffer.write(line)
                    sys.stdout.buffer.flush()
                except OSError:  # our own output is gone: keep draining the SuperNode's
                    pass

        reader = threading.Thread(target=pass_through, daemon=True)
        reader.start()
        if self.address is not None:
            threading.Thread(target=self._watch_link, args=(tag, proc.pid, ended, done), daemon=True).start()
        threading.Thread(target=self._watch_connect, args=(t0, ended, done), daemon=True).start()
        code = self._wait(proc, ended)
        ended.exited = True
        done.set()
        if left := marked(tag):
            _say(f"ending what the SuperNode started: {_named(left)}")
            stop(left)
        reader.join(timeout=2.0)  # its last lines (its children held the pipe open: ended first)
        if quiet.dropped:
            _say("(Python's traceback of Flower's exit from a thread after the goodbye, SystemExit: 0, left out)")
        return ended.close(code, time.monotonic() - t0)

    def _wait(self, proc: subprocess.Popen[bytes], ended: Ended) -> int:
        """The SuperNode's exit status. Once the wrapper is asked to stop, the SuperNode gets SIGTERM (its
        clean stop) unless it is leaving already: a Ctrl-C or a signal to the process group (systemd's
        default, ``fedhm deploy-local``'s stop) reached it too, and a second signal would cut its goodbye
        short (Flower restores the default handlers at the first). SIGKILL after :data:`STOP_GRACE`."""
        forwarded = killed = False
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                late = -1.0 if self.sigterm_at is None else time.monotonic() - self.sigterm_at
                if not forwarded and not ended.leaving and late >= 0:
                    proc.send_signal(signal.SIGTERM)
                    forwarded = True
                if not killed and late > STOP_GRACE:
                    _say(f"the SuperNode did not stop in {STOP_GRACE:g} s: SIGKILL")
                    proc.kill()
                    killed = True

    def _watch_connect(self, t0: float, ended: Ended, done: threading.Event) -> None:
        """A start that never connects is stopped for good (``ended.stuck``, exit 1; see the module's
        docstring); the port must have answered :data:`LINK_UP_FOR` s (a SuperLink that is down is waited for)."""
        crash_seen = up_since = None
        next_probe = t0
        while not done.wait(0.5):
            if ended.connected or ended.leaving or self.stopping.is_set():
                return
            now, why = time.monotonic(), ""
            crash_seen = now if ended.crash and crash_seen is None else crash_seen
            if self.address is not None and now >= next_probe:
                next_probe, up = now + 5.0, probe(self.address, timeout=2.0) == "up"
                up_since = (up_since or now) if up else None
            linked = self.address is None or (up_since is not None and now - up_since >= LINK_UP_FOR)
            if crash_seen is not None and now - crash_seen >= CRASH_GRACE:
                why = f"its start failed ({ended.crash}){hint(ended.crash)}"
            elif now - t0 >= self.connect_timeout and linked:
                where = "" if self.address is None else " although the SuperLink at {}:{} answers".format(*self.address)
                why = f"it has not connected in {now - t0:.0f} s{where} (its last line: {ended.last_line or 'none'})"
            if why and not done.is_set():
                ended.stuck, self.sigterm_at = why, now
                _say(f"flower-supernode never connected: {why}; stopping it (exit 1: a restart cannot fix that)")
                return

    def _watch_link(self, tag: str, supernode: int, ended: Ended, done: threading.Event) -> None:
        """While ClientApps run (anything marked but the SuperNode and its SuperExec), probe the SuperLink.
        When :class:`LinkWatch` says its runs are over, the SuperNode is started afresh: ending only the
        ClientApps would not free it (it waits for their replies, and Flower starts a task whose process
        is gone again, ~30 s later); a new one holds no message (its state lives in memory)."""
        assert self.address is not None
        watch, wait = self.watch(), self.probe_every[0]
        while not done.wait(wait):
            apps = [p for p in marked(tag) if p != supernode and program(p) != "flower-superexec"]
            if not apps:
                continue
            state = probe(self.address, timeout=min(5.0, self.probe_every[0]))
            wait = self.probe_every[0] if state == "up" else self.probe_every[1]
            if (why := watch.note(state, time.monotonic())) is not None and not done.is_set():
                _say(
                    f"the SuperLink at {self.address[0]}:{self.address[1]} {why}: the runs of its ClientApps "
                    f"({_named(apps)}) are over; starting the SuperNode afresh"
                )
                ended.afresh, self.sigterm_at = True, time.monotonic()
                return


def supernode_env(tag: str) -> dict[str, str]:
    """The SuperNode's environment: this one with the start's tag, and this Python environment's ``bin`` first on
    ``PATH`` (the SuperNode starts ``flower-superexec`` and that ``flwr-clientapp`` by name, also where no
    virtualenv is activated: a systemd unit)."""
    path = os.pathsep.join(p for p in (str(Path(sys.executable).parent), os.environ.get("PATH", "")) if p)
    return {**os.environ, TAG_VAR: tag, "PATH": path}


def supervise(
    args: list[str],
    wait: float = HEARTBEAT_WINDOW + MARGIN,
    binary: str | None = None,
    sleep: Callable[[float], object] | None = None,
    **options: object,
) -> int:
    """Run ``flower-supernode args`` (``binary``: another program) as the module says; ``wait``: after a refused
    activation (0: give up). 0 after a stop, else the SuperNode's last status. ``options``: :class:`Supervisor`'s."""
    return Supervisor([binary or flower_supernode(), *args], wait, sleep, **options).run()  # type: ignore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedhm supernode",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="e.g. fedhm supernode --superlink fl.example.org:8000 --root-certificates ca.pem "
        "--auth-supernode-private-key node.key --node-config node-config.toml",
    )
    parser.add_argument(
        "--restart-wait",
        type=float,
        default=HEARTBEAT_WINDOW + MARGIN,
        metavar="SECONDS",
        help="after a refused activation, wait this long, then start once more "
        f"(default {HEARTBEAT_WINDOW + MARGIN:g}: the heartbeat window plus {MARGIN:g} s; 0: no)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="stop the SuperNode and exit 1 when it has not connected this long after a start while its SuperLink "
        f"answers (default {CONNECT_TIMEOUT:g}); one whose start failed (a traceback before it connected) at once",
    )
    parser.add_argument(
        "--flower-supernode",
        metavar="PROGRAM",
        help="the program to run (default: flower-supernode of this Python environment)",
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    command = rest[1:] if rest[:1] == ["--"] else rest
    return supervise(command, args.restart_wait, args.flower_supernode, connect_timeout=args.connect_timeout)


if __name__ == "__main__":
    sys.exit(main())
