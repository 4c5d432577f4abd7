"""A run that ran on devices says so in its directory (``device_run.json``), so that ``fedhm resume`` does
not finish it as a local simulation on this machine's data: :func:`resume_refusal` gives the one line
that refuses it, with the command that resumes it on its devices.

Two writers: the ServerApp, when it runs on a SuperLink's devices (``flwr-serverapp``, not Flower's
simulation), records that SuperLink's address (:func:`note_superlink`); ``fedhm deploy-local`` records the
command that resumes its run (:func:`note_command`). Standard library only (``fedhm resume`` reads it
before anything heavy is imported).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RECORD = "device_run.json"
SERVERAPP = "flwr-serverapp"  # the program Flower runs a deployed ServerApp in (a simulation: flwr-simulation)


def read(run_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _update(run_dir: Path, **entries: Any) -> None:
    path = Path(run_dir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**read(run_dir), **entries}, indent=1) + "\n")
    tmp.replace(path)


def on_devices(argv: Sequence[str], address: tuple[str, int] | None) -> bool:
    """Whether this ServerApp process (its command line, its SuperLink's address) runs on a SuperLink's
    devices (``flwr-serverapp``), not in Flower's simulation."""
    return address is not None and bool(argv) and Path(argv[0]).name == SERVERAPP


def note_superlink(run_dir: Path, argv: Sequence[str], address: tuple[str, int] | None) -> None:
    """The ServerApp's record: the SuperLink whose devices run it (nothing in a simulation)."""
    if address is not None and on_devices(argv, address):  # (address: for mypy)
        _update(run_dir, superlink=f"{address[0]}:{address[1]}")


def note_command(run_dir: Path, resume: Sequence[str]) -> None:
    """``fedhm deploy-local``'s record: the command that resumes its run."""
    _update(run_dir, resume_command=list(resume))


def connection_for(superlink: str, flwr_home: Path | None = None) -> str | None:
    """The name of the connection in the ``flwr`` CLI's ``config.toml`` (``$FLWR_HOME``, else ``~/.flwr``)
    that reaches ``superlink`` (host:port as the ServerApp saw it: often 127.0.0.1): the only one on its
    port, or the one whose host is the same too; None when that is not clear."""
    home = flwr_home or Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    try:
        text = (home / "config.toml").read_text()
    except OSError:
        return None
    named: dict[str, str] = {}  # [superlink.NAME] ... address = "HOST:PORT" (no TOML parser on Python 3.10)
    for name, body in re.findall(r"^\[superlink\.([^\]\s]+)\]\s*$(.*?)(?=^\[|\Z)", text, flags=re.M | re.S):
        if found := re.search(r'^\s*address\s*=\s*"([^"]*)"', body, flags=re.M):
            named[name.strip('"')] = found.group(1)
    host, _, port = superlink.rpartition(":")
    same_port = [k for k, address in named.items() if address.rpartition(":")[2] == port]
    exact = [k for k in same_port if named[k].rpartition(":")[0].strip("[]") == host]
    return (exact or same_port)[0] if len(exact) == 1 or len(same_port) == 1 else None


def resume_refusal(run_dir: Path) -> str | None:
    """Why ``fedhm resume`` refuses ``run_dir``, with the command that resumes it on its devices (one line);
    None for a run that did not run on devices."""
    record = read(run_dir)
    if record.get("resume_command"):
        return (
            f"{run_dir} ran on devices (fedhm deploy-local); `fedhm resume` would finish it as a local simulation "
            f"on this machine's data. Resume it on its devices with: {shlex.join(record['resume_command'])}"
        )
    if record.get("superlink"):
        connection = connection_for(str(record["superlink"])) or "<connection>"
        config = f"\"resume='{run_dir}'\""  # as docs/DEPLOY.md writes it
        return (
            f"{run_dir} ran on the devices of the SuperLink at {record['superlink']} (flwr run on a federation); "
            "`fedhm resume` would finish it as a local simulation on this machine's data. Resume it there "
            f'(on the operator\'s machine) with: flwr run "$(fedhm stage {shlex.quote(str(run_dir) + "-app")})" '
            f"{connection} --stream --run-config {config}"
            + ("" if connection != "<connection>" else " (<connection>: that SuperLink's name in flwr's config.toml)")
        )
    return None
