"""The ServerApp's watch on its SuperLink: when the SuperLink stops under a run, the ServerApp
records it and exits within seconds, freeing the run directory's lock for a resume.

It runs inside the ServerApp process (a daemon thread, :func:`watch_superlink`), because what it
ends is that process: a SuperLink that gets SIGTERM stops listening at once but lives on while
connections stay open, and its ServerApp retries its calls with no time limit meanwhile, holding
the lock. The exit is ``os._exit`` (:func:`stop_with_superlink`): Flower's own exit path would
retry the SuperLink first; the status file and the checkpoint are written atomically before it.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from logging import ERROR
from pathlib import Path

from flwr.supercore import log
from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG, TaskType

from fedhm_flwr.ops.job.runlock import RunLock
from fedhm_flwr.reporting.results import write_status

#: the ServerApp process's argument naming its SuperLink's Runtime API (``flwr-serverapp``, ``flwr-simulation``)
# (flwr types the map's keys as TaskType; its members are plain str, the keys)
RUNTIME_ADDRESS_ARG = TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[TaskType.SERVER_APP]  # type: ignore[index]


def runtime_address(argv: Sequence[str]) -> tuple[str, int] | None:
    """(host, port) of the SuperLink this ServerApp process talks to, from its command line; None if absent."""
    args = list(argv)
    if RUNTIME_ADDRESS_ARG not in args[:-1]:
        return None
    host, _, port = args[args.index(RUNTIME_ADDRESS_ARG) + 1].rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def watch_superlink(
    address: tuple[str, int], on_gone: Callable[[], None], every: float = 1.0, misses: int = 3
) -> threading.Thread:
    """A daemon thread that calls ``on_gone`` once the SuperLink's port has refused ``misses``
    connections in a row, ``every`` s apart.

    A SuperLink that gets SIGTERM stops listening at once but lives on while connections stay open
    (``flwr run --stream`` / ``flwr log --stream``: a minute or more), and its ServerApp retries its
    calls with no time limit meanwhile, holding the run directory's lock; only when the SuperLink's
    process is gone does Flower stop the ServerApp. A refused connection is certain (nothing
    listens); a timeout is not counted."""

    def loop() -> None:
        refused = 0
        while refused < misses:
            time.sleep(every)
            try:
                socket.create_connection(address, timeout=every).close()
                refused = 0
            except ConnectionRefusedError:
                refused += 1
            except OSError:
                pass
        on_gone()

    thread = threading.Thread(target=loop, name="fedhm-superlink-watch", daemon=True)
    thread.start()
    return thread


def stop_with_superlink(out_dir: Path, rounds: int, done: int, address: tuple[str, int], lock: RunLock) -> None:
    """The SuperLink stopped under this ServerApp: record it (``done`` of ``rounds`` rounds; the last
    checkpoint stays) and exit now."""
    reason = (
        f"the SuperLink at {address[0]}:{address[1]} stopped under the ServerApp (its port refuses "
        "connections); the run stopped with it and can be resumed from its last checkpoint"
    )
    log(ERROR, "fedhm-flwr: %s", reason)
    write_status(out_dir, "failed", error=reason, rounds=rounds, round=done)
    lock.release()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # Flower's own exit would retry the SuperLink first; the checkpoint is written atomically
