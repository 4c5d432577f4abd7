"""Where the seconds before round 1 go: the marks a launched job takes on its way (the launcher's in
``timings.json``, the ServerApp's and the first simulated node's in the summary's ``startup_marks``),
turned into consecutive parts that add up to the wait (:func:`startup_parts`), and the one line that
says them (:func:`parts_line`).

Every mark is a wall-clock time (``time.time()``) taken on the job's own machine: the simulated nodes
run there, so their marks (when their worker process started, imported the ClientApp and answered
its first query) share the server's clock. The parts follow the path the ServerApp waits on: a part
ends at its mark or, where that mark came earlier (Ray starts beside the ServerApp's set-up), is 0 s.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: ``<run dir>/timings.json``: the launcher's marks (wall clock) of a launched job's start-up and end,
#: written before ``flwr run`` starts (the ServerApp reads them: :func:`launcher_marks`) and again, whole,
#: with the start-up's parts, when the job ends
TIMINGS_FILE = "timings.json"

#: (mark, the part that ends at it), in the order of the path before round 1; the first mark present
#: starts the clock. Launcher marks: ``fedhm_flwr.ops.job.launch`` (``timings.json``); the rest: the
#: ServerApp's summary (``startup_marks``).
PARTS: tuple[tuple[str, str], ...] = (
    ("launcher_process_started_at", ""),
    ("launcher_started_at", "launcher: Python start and imports"),
    ("checked_at", "config and data check"),
    ("superlink_ready_at", "SuperLink start"),
    ("app_staged_at", "app staging"),
    ("simulation_started_at", "flwr run: app bundle, submission, simulation process start"),
    ("serverapp_main_at", "simulation process: imports, ClientApp and ServerApp load"),
    ("startup_started_at", "ServerApp set-up: config, test set, model, strategy (Ray starts meanwhile)"),
    ("worker_started_at", "Ray start and the first worker process (what is left of it)"),
    ("worker_imported_at", "the worker's imports (Ray worker, torch, flwr, the ClientApp)"),
    ("first_answered_at", "the first node-info answer: data decoding, partitions"),
    ("first_arrived_at", "its way to the ServerApp"),
    ("rounds_started_at", "the other nodes' node-info answers"),
)


def startup_parts(marks: Mapping[str, float | None]) -> dict[str, float]:
    """The parts (seconds, in path order) of the wait from the first mark present to the last: each
    part runs from the latest mark before it to its own (0 where its mark came earlier); a missing
    mark's part is left out and its time goes to the next part present. Marks that are not finite
    numbers count as missing. ``{}`` with fewer than two marks."""
    parts: dict[str, float] = {}
    last: float | None = None
    for mark, part in PARTS:
        value = marks.get(mark)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue
        if last is not None:
            parts[part] = max(0.0, float(value) - last)
        last = float(value) if last is None else max(last, float(value))
    return parts


def parts_line(parts: Mapping[str, float]) -> str:
    """One line: the total and each part of at least 0.05 s, largest first."""
    total = sum(parts.values())
    shown = sorted(((s, p) for p, s in parts.items() if s >= 0.05), reverse=True)
    return f"{total:.1f} s before round 1: " + "; ".join(f"{p} {s:.1f} s" for s, p in shown)


def launcher_marks(run_dir: Path) -> dict[str, float]:
    """The marks the launcher of this session of ``run_dir`` wrote before ``flwr run`` (``{}`` when no
    launcher started the run: an in-process run, a deployment; or the file is a finished session's)."""
    try:
        marks: dict[str, Any] = json.loads((run_dir / TIMINGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(marks, dict) or "cleaned_up_at" in marks:  # a finished session's whole record
        return {}
    return {k: float(v) for k, v in marks.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def process_started_at(pid: int | None = None) -> float | None:
    """When a process (default: this one) started, wall clock to 10 ms, from Linux's ``/proc`` (its
    start in clock ticks after boot against the uptime now); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime, after the command
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
