"""One simulation SuperLink for all the jobs of a sweep or a comparison (``fedhm sweep``, ``fedhm compare``).

Without it every job starts its own ``flower-superlink`` and waits for its ``/health`` (about 3 s of each
job's start-up, bench figure 8). :func:`shared_superlink` starts one for the whole sweep, on a free loopback
port, in a temporary ``FLWR_HOME``, without waiting for it (it starts while the sweep's process and its first
job start; a job waits for its ``/health``), through a :class:`~fedhm_flwr.ops.job.procs.Processes` of its own (its
own tag and watchdog: it stops when the sweep's process dies, even by SIGKILL), and hands it down to the
jobs in :data:`SHARED_SUPERLINK_VAR`. The launcher then names it in the job's own CLI ``config.toml`` instead
of starting one (:func:`handed_down`); the job's ``flwr run``, ``flwr list`` and ``flwr stop`` talk to it.

Only for jobs that run one after another (Hydra's basic launcher): a job then owns every process the
SuperLink starts besides the SuperLink and its SuperExec (its run's ``flwr-simulation`` and Ray), so it
stops them as its own, its ServerApp on an interrupt (:meth:`HandedDown.run_tag`) and whatever of its run is
left when it ends (:func:`end_run`). Not where the sweep names a Ray cluster (``simulation.ray_address``:
a SuperLink's environment carries its runs' Ray address) or a Hydra launcher, which may run jobs side by
side; then each job starts its own, as it does with ``FEDHM_SHARED_SUPERLINK=0``. A job's final model is the
same, tensor by tensor, either way (bench figure 8 compares them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fedhm_flwr.ops.job.procs import Processes, kill_tagged, tagged_pids
from fedhm_flwr.ops.job.superlink import (
    GUARD_MODULE,
    await_health,
    connect_simulation_superlink,
    free_port,
    start_simulation_superlink,
)

#: the sweep's SuperLink, for its jobs: JSON ``{"address": "127.0.0.1:PORT", "tag", "ray_address", "log"}``
SHARED_SUPERLINK_VAR = "FEDHM_SHARED_SUPERLINK_ADDRESS"
#: ``0`` (or ``false``, ``no``, ``off``): each job of a sweep starts its own SuperLink; else they share one
SHARED_SUPERLINK_SWITCH = "FEDHM_SHARED_SUPERLINK"
#: the processes that serve every job of the sweep, the SuperLink's guard among them (the rest under its
#: tag belong to the job running)
SUPERLINK_COMMANDS = (GUARD_MODULE, "flower-superlink", "flower-superexec")


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether sweeps share one SuperLink (:data:`SHARED_SUPERLINK_SWITCH`: on unless set to 0/false/no/off)."""
    value = (environ if environ is not None else os.environ).get(SHARED_SUPERLINK_SWITCH, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class HandedDown:
    """The sweep's SuperLink as a job sees it."""

    address: str  # HOST:PORT of its Control API (what the CLI's config.toml names)
    tag: str  # the tag of every process it starts (:data:`~fedhm_flwr.ops.job.procs.TAG_VAR`)
    ray_address: str | None  # the Ray cluster its runs use (None: a private instance per run)
    log: Path  # its log

    def connect(self, flwr_home: Path, timeout: float = 60) -> dict[str, str]:
        """A job's CLI environment for it (its ``config.toml`` in ``flwr_home``), once it answers (the sweep
        does not wait for its start; the first job does)."""
        env = connect_simulation_superlink(flwr_home, self.port)
        await_health(self.port, self.log, timeout=timeout)
        return env

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


def handed_down(ray_address: str | None, environ: dict[str, str] | None = None) -> HandedDown | None:
    """The sweep's SuperLink for a job whose runs use ``ray_address`` (None: a private Ray instance), or
    None when none is handed down or it serves another Ray address (the job then starts its own)."""
    raw = (environ if environ is not None else os.environ).get(SHARED_SUPERLINK_VAR)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        shared = HandedDown(
            str(data["address"]), str(data["tag"]), data.get("ray_address") or None, Path(data.get("log") or "")
        )
        shared.port  # noqa: B018 - a malformed address is no shared SuperLink
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return shared if shared.ray_address == (ray_address or None) else None


def run_pids(tag: str) -> list[int]:
    """The processes of the run on the shared SuperLink ``tag``: every tagged one but the SuperLink and
    its SuperExec (in a sweep whose jobs run one after another, they are the running job's)."""
    return tagged_pids(tag, SUPERLINK_COMMANDS)


def end_run(tag: str, settle: float = 10.0) -> list[int]:
    """Once a job's run has ended: wait up to ``settle`` s for its processes on the shared SuperLink
    (``flwr-simulation``, Ray) to exit on their own, then stop what is left; returns what was stopped."""
    deadline = time.monotonic() + settle
    while run_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = run_pids(tag)
    if left:
        kill_tagged(tag, grace=3.0, spare=SUPERLINK_COMMANDS)
    return left


@contextlib.contextmanager
def shared_superlink(ray_address: str | None = None) -> Iterator[dict[str, str]]:
    """A simulation SuperLink for the block (its runs use ``ray_address``, None: a private Ray instance
    each); yields the environment that hands it to the jobs. Stopped, with every process it started, on
    exit; its log is kept (and named) when the block ends with an error, else removed."""
    home = Path(tempfile.mkdtemp(prefix="fedhm-superlink-"))
    log = home / "superlink.log"
    ok = False
    try:
        with Processes() as procs:
            port = free_port()
            # not waited for here: it starts while the sweep's process and its first job start (each job waits)
            start_simulation_superlink(procs, home, log, ray_address=ray_address, port=port, wait=False)
            shared = {"address": f"127.0.0.1:{port}", "tag": procs.tag, "ray_address": ray_address, "log": str(log)}
            yield {SHARED_SUPERLINK_VAR: json.dumps(shared)}
            ok = True
    finally:
        if ok:
            shutil.rmtree(home, ignore_errors=True)
        elif log.is_file():
            print(f"the sweep's SuperLink: its log is {log}", file=sys.stderr, flush=True)
