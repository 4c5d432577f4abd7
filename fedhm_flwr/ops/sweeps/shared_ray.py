"""One Ray instance for all the jobs of a sweep or a comparison (``fedhm sweep``, ``fedhm compare``).

Every job of a sweep starts, without this, its own Ray instance (its SuperLink is the sweep's,
:mod:`fedhm_flwr.ops.sweeps.shared_superlink`): seconds of start-up per job (bench figure 8 measures both).
:func:`shared_ray` starts one local Ray instance for the whole sweep in a supervisor process (``python -m
fedhm_flwr.ops.sweeps.ray_supervisor``: ``ray.init``, then it waits), hands its address to the jobs in
:data:`SHARED_RAY_VAR` (the launcher passes it on as ``simulation.ray_address`` does; an address set in the
config wins) and stops it at the end, also on failure or Ctrl-C: the supervisor is ended by its own process id
(its ``ray.shutdown`` stops the Ray processes it started, and only those), and it also ends when the sweep's
process dies (``PR_SET_PDEATHSIG``) or its stdin closes.

Off unless ``FEDHM_SHARED_RAY=1``: in bench figure 8 (a two-job sweep of 2-round jobs) it saved
5-8 s of each job's start-up but not the sweep's wall time. A job's final model is the same, tensor
by tensor, with a shared or a private Ray instance (figure 8 compares them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from fedhm_flwr.ops.job.superlink import RAY_QUIET_START

#: the address of the sweep's shared Ray instance, for its jobs (fedhm_flwr/ops/job/launch.py)
SHARED_RAY_VAR = "FEDHM_SHARED_RAY_ADDRESS"
#: ``1`` (or ``true``, ``yes``, ``on``): a sweep's jobs share one Ray instance; else each starts its own
SHARED_RAY_SWITCH = "FEDHM_SHARED_RAY"
#: the supervisor's line naming the instance's address (``READY HOST:PORT``)
READY = "fedhm-shared-ray address "


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether sweeps share one Ray instance (:data:`SHARED_RAY_SWITCH`: off unless set to 1/true/yes/on)."""
    return (environ if environ is not None else os.environ).get(SHARED_RAY_SWITCH, "0").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def shared_ray(num_cpus: int | None = None, timeout: float = 120) -> Iterator[str]:
    """A local Ray instance for the block; yields its address (``HOST:PORT``). Stopped on exit."""
    cmd = [sys.executable, "-m", "fedhm_flwr.ops.sweeps.ray_supervisor", str(num_cpus or os.cpu_count() or 1)]
    env = {**RAY_QUIET_START, **os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    try:
        address = _await_address(proc, timeout)
        yield address
    finally:
        _stop(proc)


def _await_address(proc: subprocess.Popen[str], timeout: float) -> str:
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY):
                found.append(line[len(READY) :].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        raise RuntimeError(
            f"the shared Ray instance did not start in {timeout:g} s "
            f"({'still starting' if proc.poll() is None else f'exit {proc.returncode}'}); "
            f"{SHARED_RAY_SWITCH}=0 runs each job with its own"
        )
    return found[0]


def _stop(proc: subprocess.Popen[str], wait: float = 30) -> None:
    """End the supervisor (SIGTERM: its ray.shutdown), then, if it lingers, kill it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
