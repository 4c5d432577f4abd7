"""The run directory's lock: one live run per directory.

:class:`RunLock` (``<run dir>/.lock``, an ``fcntl.flock``) keeps a second launch out of a run
directory that a live run is using; the launcher, ``fedhm deploy-local`` and the ServerApp take it.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from fedhm_flwr.ops.job.procs import alive

LOCK_FILE = ".lock"


class RunDirectoryBusy(FileExistsError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<run dir>/.lock``, held while a run uses the directory.

    The lock file records the holder's PID and job tag (JSON). The kernel drops the lock when
    every descriptor of it is closed, i.e. when the holder (and the watchdog it handed the
    descriptor to) has exited: a lock file left by a dead process never blocks. A process of the
    holder's own job (same ``FEDHM_RUN_TAG`` in its environment, e.g. the ServerApp started by
    the launcher) is let in without locking: ``RunLock(out_dir, tag=os.environ.get(TAG_VAR))``; so is
    one carrying a tag the holder names in ``guests`` (the ServerApp a sweep's shared SuperLink starts
    for the job holding the lock, :mod:`fedhm_flwr.ops.sweeps.shared_superlink`).
    """

    def __init__(self, run_dir: str | Path, tag: str | None = None, guests: tuple[str, ...] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.tag = tag
        self.guests = guests
        self.fd: int | None = None

    def holder(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.path.read_text() or "{}"))
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.holder()
            if self.tag and (holder.get("tag") == self.tag or self.tag in (holder.get("guests") or [])):
                return self  # the run's own launcher holds it
            pid = holder.get("pid")
            if isinstance(pid, int) and alive(pid):
                why = f"a live run (PID {pid}) is using it"
            else:
                why = f"the processes of a run whose launcher (PID {pid}) has died are still being stopped"
            raise RunDirectoryBusy(
                f"run directory {self.run_dir} is locked: {why} ({self.path}); "
                "wait for that run to end or stop it (Ctrl-C / kill -INT <PID>), "
                "or choose another run directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "tag": self.tag, "guests": list(self.guests)}).encode())
        self.fd = fd
        return self

    @staticmethod
    def is_held(run_dir: str | Path) -> bool:
        """Whether a live process holds ``run_dir``'s lock (a probe: takes a shared lock for an
        instant when it is free, writes nothing)."""
        try:
            fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # drops the probe's own lock
        return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (harmless, see above)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
