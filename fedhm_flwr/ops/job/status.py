"""``fedhm status <run dir>``: a run's outcome from its directory, for scripts and deployments.

The ServerApp writes ``status.json`` into its run directory (``running`` when it starts,
``completed`` or ``failed`` with the error when it ends) and holds the directory's lock
(``.lock``, :class:`fedhm_flwr.ops.job.runlock.RunLock`) while it runs. A ServerApp that was killed (or
whose SuperLink was stopped under it) leaves ``running`` behind with the lock free: the run
*stopped*. ``flwr run --stream`` exits 0 whatever became of the run; this command does not:

=====  ==============================================================
exit   the run
=====  ==============================================================
0      completed
1      failed (the error, one line) or stopped (the ServerApp is gone)
2      not a run directory (no ``status.json`` and no ``summary.json``)
3      still running (``--wait``: wait for its end instead)
=====  ==============================================================

The last complete checkpoint's round is named when the run did not complete.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fedhm_flwr.ops.job.runlock import RunLock
from fedhm_flwr.reporting.results import SUMMARY_FILE, load_checkpoint_state, read_status
from fedhm_flwr.reporting.startup import parts_line

COMPLETED, FAILED, NOT_A_RUN, RUNNING = 0, 1, 2, 3


def run_status(run_dir: Path) -> tuple[int, str]:
    """(exit code, one line) for the run in ``run_dir``."""
    status = read_status(run_dir)
    if status is None:
        if (run_dir / SUMMARY_FILE).is_file():  # a run from before status.json
            return COMPLETED, f"{run_dir}: completed"
        return NOT_A_RUN, f"{run_dir}: not a run directory (no status.json, no {SUMMARY_FILE})"
    state = status.get("status")
    rounds = status.get("rounds")
    if state == "completed":
        return COMPLETED, f"{run_dir}: completed ({status.get('round')}/{rounds} rounds){_startup(run_dir)}"
    saved = _checkpoint_round(run_dir)
    where = f"; last checkpoint: round {saved}" if saved is not None else "; no checkpoint"
    if state == "running":
        if RunLock.is_held(run_dir):
            return RUNNING, f"{run_dir}: running ({_rounds(run_dir)}/{rounds} rounds done{where})"
        return FAILED, (
            f"{run_dir}: stopped: its ServerApp is gone without an end (killed, or its SuperLink "
            f"stopped) after {_rounds(run_dir)}/{rounds} rounds{where}"
        )
    return FAILED, f"{run_dir}: failed after {status.get('round')}/{rounds} rounds{where}: {status.get('error')}"


def _startup(run_dir: Path) -> str:
    """``; <the start-up before round 1, by part>`` from the run's summary (empty when it has none)."""
    try:
        parts = json.loads((run_dir / SUMMARY_FILE).read_text()).get("startup_parts")
    except (OSError, ValueError, AttributeError):
        return ""
    return f"; {parts_line(parts)}" if isinstance(parts, dict) and parts else ""


def _checkpoint_round(run_dir: Path) -> int | None:
    try:
        return int(load_checkpoint_state(run_dir)["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _rounds(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def main(run_dir: Path, wait: bool = False, poll: float = 2.0) -> int:
    run_dir = run_dir.expanduser().resolve()
    code, line = run_status(run_dir)
    while wait and code == RUNNING:
        time.sleep(poll)
        code, line = run_status(run_dir)
    print(line, file=sys.stdout if code in (COMPLETED, RUNNING) else sys.stderr)
    return code
