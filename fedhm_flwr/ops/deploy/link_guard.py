"""``fedhm superlink ARGS``: ``flower-superlink ARGS`` that does not stay up without its helper.

A SuperLink runs every ServerApp through a helper it starts by name, ``flower-superexec`` (Flower 1.42,
``--isolation subprocess``, the default), which connects back to the SuperLink's own port over TLS. When
that helper cannot start or dies (the certificate does not name the address it connects to,
``localhost`` / ``127.0.0.1``: ``CERTIFICATE_VERIFY_FAILED``), the SuperLink keeps serving: devices
connect, ``flwr run`` is accepted, and the run stays pending for ever. This wrapper passes every argument
and line through, and watches the helper (the process started with ``--parent-pid <SuperLink>``): when
it has ended, or has not appeared :data:`HELPER_WAIT` s after the start, it says so in one line (with the
helper's last error and what to do), stops the SuperLink (SIGTERM, SIGKILL after :data:`STOP_GRACE` s)
and exits 1, so that the service manager sees the failure. A SuperLink that exits by itself: its status,
with its last error. SIGTERM / SIGINT / SIGHUP go on to the SuperLink (its clean stop) unless it has stopped
:data:`FORWARD_AFTER` s later (the signal reached it too: its process group); exit 0. ``fedhm run``'s
launcher and ``fedhm deploy-local`` start their SuperLink under this guard too.

The SuperLink gets this Python environment's ``bin`` first on ``PATH`` (Flower starts ``flower-superexec``
and ``flwr-serverapp`` by name). Standard library only, as ``fedhm supernode``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedhm_flwr.ops.deploy.node_output import Ended, hint
from fedhm_flwr.ops.deploy.supernode import alive, children, exit_status, program, stop

HELPER = "flower-superexec"
HELPER_WAIT = 30.0  # a SuperLink that has not started its helper this long after its own start
STOP_GRACE = 15.0
FORWARD_AFTER = 1.5  # a stop signal goes on to a SuperLink still running this much later
CERT_HINT = (
    ": the SuperLink's certificate must also name the address its helper connects to (localhost, 127.0.0.1: "
    "subjectAltName, docs/DEPLOY.md)"
)


def _say(message: str) -> None:
    print(f"[fedhm superlink] {message}", file=sys.stderr, flush=True)


def helper_of(superlink: int) -> int | None:
    """The ``flower-superexec`` a SuperLink process started (None: none runs)."""
    found = [p for p in children(superlink) if program(p) == HELPER and alive(p)]
    return found[0] if found else None


def why_helper_failed(ended: Ended) -> str:
    """The helper's last error as the passed-through output shows it, with what to do."""
    error = ended.crash or ended.last_line or "no error line"
    return f"its last error: {error}" + (CERT_HINT if "CERTIFICATE_VERIFY_FAILED" in error else hint(error))


def guard(command: list[str], helper_wait: float = HELPER_WAIT) -> int:
    """Run ``command`` (``flower-superlink ...``) as the module says; its exit status, or 1 for a lost helper."""
    path = os.pathsep.join(p for p in (str(Path(sys.executable).parent), os.environ.get("PATH", "")) if p)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PATH": path})
    ended, stopping = Ended(), threading.Event()

    def pass_through() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            ended.read(raw)
            try:
                sys.stdout.buffer.write(raw)
                sys.stdout.buffer.flush()
            except OSError:
                pass

    def forward() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def on_signal(signum: int, _frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        _say(f"{signal.Signals(signum).name} received: stopping the SuperLink")
        # a signal to the process group (the launcher's stop, Ctrl-C) reached the SuperLink too: a second one
        # would cut its clean stop short (Flower restores the default handlers at the first)
        timer = threading.Timer(FORWARD_AFTER, forward)
        timer.daemon = True  # a SuperLink that stopped sooner ends this process at once
        timer.start()

    reader = threading.Thread(target=pass_through, daemon=True)
    reader.start()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    watched = "--isolation" not in command or command[command.index("--isolation") + 1 :][:1] == ["subprocess"]
    t0, helper, lost = time.monotonic(), None, ""
    try:
        while proc.poll() is None and not stopping.wait(1.0):
            now = helper_of(proc.pid) if watched else None
            if now is not None:
                helper = now
            elif watched and helper is not None:
                lost = f"its {HELPER} (pid {helper}), which starts every ServerApp, has ended"
            elif watched and time.monotonic() - t0 > helper_wait:
                lost = f"it has not started its {HELPER} (which starts every ServerApp) in {helper_wait:g} s"
            if lost:
                time.sleep(0.5)  # the helper's last lines
                _say(f"{lost} ({why_helper_failed(ended)}): no run can start; stopping the SuperLink (exit 1)")
                stop([proc.pid], STOP_GRACE)
                break
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if left := [p for p in children(proc.pid) if alive(p)]:
            stop(left)
        reader.join(timeout=2.0)
    if lost:
        return 1
    if stopping.is_set():
        return 0
    _say(f"flower-superlink ended: {exit_status(code)} ({why_helper_failed(ended)})")
    return code if code > 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedhm superlink",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="e.g. fedhm superlink --ssl-ca-certfile ca.pem --ssl-certfile server.pem --ssl-keyfile server.key "
        "--enable-supernode-auth --database state.db",
    )
    parser.add_argument(
        "--helper-wait",
        type=float,
        default=HELPER_WAIT,
        metavar="SECONDS",
        help=f"how long the SuperLink may take to start its {HELPER} (default {HELPER_WAIT:g})",
    )
    parser.add_argument(
        "--flower-superlink", metavar="PROGRAM", help="the program to run (default: this environment's)"
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    binary = args.flower_superlink or str(Path(sys.executable).parent / "flower-superlink")
    return guard([binary, *(rest[1:] if rest[:1] == ["--"] else rest)], args.helper_wait)


if __name__ == "__main__":
    sys.exit(main())
