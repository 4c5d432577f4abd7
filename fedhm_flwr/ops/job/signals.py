"""SIGINT, SIGTERM and SIGHUP during a job: :func:`on_signals` turns the first into one
:class:`Interrupted` exception, so the job's cleanup (:mod:`fedhm_flwr.ops.job.procs`) runs; a second
signal during the cleanup only prints that the cleanup goes on."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_DEPTH = {"depth": 0, "raised": False}  # nested on_signals blocks share one "already interrupted" flag


@contextlib.contextmanager
def on_signals(say: Any = None) -> Iterator[None]:
    """Within the block the first SIGINT / SIGTERM / SIGHUP raises :class:`Interrupted`; later ones
    only print that the cleanup goes on (so a second Ctrl-C cannot cut the cleanup short).

    Blocks may nest (an entry point's ``main`` and the launcher's ``run_job``): they share one
    flag, so a signal that arrives while an outer block reports the first one only prints too;
    the flag is reset when the outermost block ends (a notebook can run and interrupt again).
    Outside the main thread this does nothing (Python delivers signals to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def handler(signum: int, _frame: Any) -> None:
        if _DEPTH["raised"]:
            say(f"{signal.Signals(signum).name} received: still stopping the run's processes, please wait")
            return
        _DEPTH["raised"] = True
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    _DEPTH["depth"] += 1
    try:
        yield
    finally:
        _DEPTH["depth"] -= 1
        if _DEPTH["depth"] == 0:
            _DEPTH["raised"] = False
        for sig, old in previous.items():
            signal.signal(sig, old)
