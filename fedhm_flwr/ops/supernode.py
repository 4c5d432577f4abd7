"""``fedhm supernode ARGS``: ``flower-supernode ARGS`` that comes back after a kill.

Why a SuperNode restarted right after a kill is refused (Flower 1.41): a SuperNode that stops
normally (SIGTERM, Ctrl-C) tells the SuperLink it leaves (``DeactivateNode``); one that is killed
(SIGKILL, power cut, OOM killer) cannot, so the SuperLink keeps its session ``online`` until its
heartbeats lapse: ``HEARTBEAT_PATIENCE`` × ``HEARTBEAT_DEFAULT_INTERVAL`` (2 × 30 s) after the
last one. The SuperLink activates only a node that is registered or offline, so a restart inside
that window gets ``[code: 2004] Failed to activate SuperNode`` (HTTP 412), which the SuperNode does
not retry: it stops for good (``Exit Code: 305``; the process exits with status 1).

This wrapper runs ``flower-supernode`` with the same arguments, its output passed through. When
the SuperNode stops after the SuperLink refused its activation (code 2004), the wrapper
says so in one line, waits until the old session has surely lapsed (the heartbeat window after
the refusal, plus a few seconds so that a round waiting on the old session sees it gone and
records ``node unavailable`` instead of waiting for its timeout) and starts it again. A key that
is not registered is refused the same way (the SuperLink tells the node nothing more): if the
activation is still refused after the window, the wrapper gives up with the SuperNode's exit code.
SIGTERM / SIGINT are passed on to the SuperNode (a clean stop, which lets it restart at once).

Standard library plus Flower's own constants: nothing of the app is imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE
from flwr.supercore.error import ApiErrorCode

#: the SuperLink's code for a refused activation, in the SuperNode's last lines (after Flower's
#: "Exit Code: 305"; the process itself exits with status 1)
ACTIVATION_FAILED = f"[code: {int(ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED)}]"  # 2004
#: how long the SuperLink keeps a node that sent no goodbye online after its last heartbeat
HEARTBEAT_WINDOW = float(HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL)
#: the wait after the window: a round's pull loop must see the old session gone before it is back
MARGIN = 5.0


def _say(message: str) -> None:
    print(f"[fedhm supernode] {message}", file=sys.stderr, flush=True)


def flower_supernode() -> str:
    """``flower-supernode`` of this Python environment (also without an activated venv)."""
    candidate = Path(sys.executable).parent / "flower-supernode"
    return str(candidate) if candidate.exists() else (shutil.which("flower-supernode") or "flower-supernode")


def children(pid: int) -> list[int]:
    """Live processes started with ``--parent-pid <pid>`` (what a SuperNode gives its
    ``flower-superexec``; they may outlive it), found in ``/proc`` (none where there is no /proc)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a == b"--parent-pid" and b == str(pid).encode() for a, b in zip(args, args[1:])):
            found.append(int(entry.name))
    return found


def stop(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM these processes, SIGKILL those still there after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        end = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)


def run_once(command: list[str], forward: Callable[[subprocess.Popen[bytes]], None]) -> tuple[int, bool]:
    """Run the SuperNode once, its output passed through; (exit code, whether the SuperLink
    refused its activation). Ends when the SuperNode exits (not when its output closes: a child
    it started may outlive it and hold the output open); after a refused start, the children it
    left are stopped."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    forward(proc)
    refused = threading.Event()

    def pass_through() -> None:
        assert proc.stdout is not None
        out = sys.stdout.buffer
        for line in proc.stdout:
            if ACTIVATION_FAILED.encode() in line:  # follows the "Exit Code: 305" line
                refused.set()
            try:
                out.write(line)
                out.flush()
            except OSError:  # our own output is gone: keep draining the SuperNode's
                pass

    reader = threading.Thread(target=pass_through, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=2.0)  # the lines written before it exited
    if refused.is_set():
        left = children(proc.pid)
        if left:
            _say(f"stopping what the refused SuperNode left running: {left}")
            stop(left)
    return code, refused.is_set()


def supervise(args: list[str], wait: float = HEARTBEAT_WINDOW + MARGIN, binary: str | None = None,
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Run ``flower-supernode args``; after a refused activation, wait ``wait`` seconds once and
    try again. Returns the SuperNode's last exit code."""
    command = [binary or flower_supernode(), *args]
    current: list[subprocess.Popen[bytes]] = []
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        for proc in current:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    def forward(proc: subprocess.Popen[bytes]) -> None:
        current[:] = [proc]

    code, refused = run_once(command, forward)
    if code == 0 or not refused or wait <= 0 or stopping.is_set():
        return code
    _say(f"the SuperLink refused to activate this node ({ACTIVATION_FAILED}): after a kill it keeps the node's "
         f"old session online until its heartbeats lapse ({HEARTBEAT_WINDOW:g} s); starting again in {wait:g} s "
         "(an unregistered key fails the same way: see `flwr supernode ls`)")
    left = wait
    while left > 0 and not stopping.is_set():
        step = min(1.0, left)
        sleep(step)
        left -= step
    if stopping.is_set():
        return code
    code, refused = run_once(command, forward)
    if code != 0 and refused:
        _say(f"still refused after {wait:g} s: the key is not registered with this SuperLink, or belongs to "
             "another node (`flwr supernode ls`, `flwr supernode register`)")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedhm supernode", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__, epilog="Every other argument goes to flower-supernode unchanged, e.g. "
        "`fedhm supernode --superlink fl.example.org:8000 --root-certificates ca.pem "
        "--auth-supernode-private-key node.key --node-config node-config.toml`.")
    parser.add_argument("--restart-wait", type=float, default=HEARTBEAT_WINDOW + MARGIN, metavar="SECONDS",
                        help="after a refused activation, wait this long, then start once more "
                             f"(default {HEARTBEAT_WINDOW + MARGIN:g}: the heartbeat window plus {MARGIN:g} s; 0: never)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return supervise(rest, args.restart_wait)


if __name__ == "__main__":
    sys.exit(main())
