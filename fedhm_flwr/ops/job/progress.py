"""A progress line you can wait on: round i/N, elapsed, ETA, last accuracy, failures.

``fedhm run``, ``sweep`` and ``compare`` run the launcher quietly (Flower's output goes to the run
directory's ``flwr_run.log``) and follow the run directory's ``metrics.jsonl`` meanwhile. On a
terminal one line is rewritten in place (every second, and at every round); elsewhere (a log
file, CI, a pipe) one plain line is printed per round.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from fedhm_flwr.config import load_config, resume_config, run_options
from fedhm_flwr.ops.job.launch import default_run_dir, run_job
from fedhm_flwr.ops.job.outcome import checkpoint_round, require_checkpoint, require_local_run
from fedhm_flwr.reporting.results import METRICS_JSONL

#: what the ETA names, unmeasured, while the last round is to come: the deployment statistics query
#: of the last round (``evaluation.deploy_stats``), whose cost is known only once it has run
FINAL_STATISTICS = "the final statistics query"


def eta_seconds(
    elapsed: float, done: int, remaining: int, since_first: float | None = None, round_seconds: float | None = None
) -> float | None:
    """Seconds left if the remaining rounds take as long as the ones done so far (None: none done).

    ``since_first``: seconds since the first round of this session ended. With two rounds or more
    the pace is measured from there, leaving out the start-up (SuperLink, Ray, the nodes' first
    contact) that the elapsed time includes; after one round, that round's own wall time
    (``round_seconds``, the row's ``seconds``) when known."""
    if done <= 0:
        return None
    if done >= 2 and since_first is not None:
        pace = since_first / (done - 1)
    else:
        pace = round_seconds if done == 1 and round_seconds else elapsed / done
    return pace * max(0, remaining)


def format_seconds(seconds: float | None) -> str:
    """``m:ss`` or ``h:mm:ss``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (written atomically: never a partial line); [] if absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def progress_text(
    rows: Sequence[Mapping[str, Any]],
    total: int,
    elapsed: float,
    done: int,
    label: str = "",
    since_first: float | None = None,
    last_extra: str = "",
) -> str:
    """The progress line after ``rows`` (all of the run's rows; ``done`` of them in this session,
    the first of which ended ``since_first`` seconds ago). ``last_extra``: the work the last round
    does past a round (the final statistics query), which the ETA names instead of guessing it: its
    cost is known only once it has run."""
    current = int(rows[-1]["round"]) if rows else 0
    eta = eta_seconds(elapsed, done, total - current, since_first, rows[-1].get("seconds") if rows else None)
    more = f" + {last_extra}" if last_extra and current < total else ""
    parts = [
        f"{label}round {current}/{total}",
        f"elapsed {format_seconds(elapsed)}",
        f"ETA {format_seconds(eta)}{more}",
    ]
    accs = [r["acc/global"] for r in rows if r.get("acc/global") is not None]
    parts.append(f"acc {accs[-1]:.4f}" if accs else "acc -")
    parts.append(f"failures {sum(int(r.get('failures', 0) or 0) + int(r.get('rejected', 0) or 0) for r in rows)}")
    return " | ".join(parts)


class Follower:
    """Follows a run directory's ``metrics.jsonl`` and writes the progress to ``stream``."""

    def __init__(
        self,
        run_dir: Path,
        total: int,
        stream: TextIO | None = None,
        tty: bool | None = None,
        label: str = "",
        clock: Callable[[], float] = time.monotonic,
        done: int | None = None,
        last_extra: str = "",
    ) -> None:
        self.path = Path(run_dir) / METRICS_JSONL
        self.total, self.label, self.clock, self.last_extra = total, label, clock, last_extra
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.start = clock()
        rows = read_rows(self.path)
        # a resumed run's earlier rounds are not this session's: those up to its checkpoint (``done``).
        # Rows past it (a session stopped between a round's row and its checkpoint) are stale: the
        # resume rewrites them; until then they are not shown
        self.seen = len(rows) if done is None else min(done, len(rows))
        self.first = self.seen
        self._stale = rows[self.seen :]
        self.first_done_at: float | None = None  # when this session's first round was seen
        self._lock = threading.Lock()  # the poller thread and say() write to one stream
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, line: str) -> None:
        """A line of its own above the progress line (the run's first error, as soon as it is seen)."""
        with self._lock:
            self.stream.write(("\r" if self.tty else "") + f"{self.label}{line}" + ("\x1b[K\n" if self.tty else "\n"))
            self.stream.flush()

    def poll(self) -> None:
        """Print what changed: a line per new round (plain) or the refreshed line (terminal)."""
        with self._lock:
            self._poll()

    def _current(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows up to the first stale one still in place (all of them once the resume rewrote them)."""
        for index, stale in enumerate(self._stale, self.first):
            if index < len(rows) and rows[index] == stale:
                return rows[:index]
        return rows

    def _poll(self) -> None:
        rows = self._current(read_rows(self.path))
        now = self.clock()
        elapsed = now - self.start
        if self.first_done_at is None and len(rows) > self.first:
            self.first_done_at = now
        since = None if self.first_done_at is None else now - self.first_done_at
        if self.tty:
            self.stream.write(
                "\r"
                + progress_text(rows, self.total, elapsed, len(rows) - self.first, self.label, since, self.last_extra)
                + "\x1b[K"
            )
        else:
            for n in range(self.seen + 1, len(rows) + 1):
                self.stream.write(
                    progress_text(rows[:n], self.total, elapsed, n - self.first, self.label, since, self.last_extra)
                    + "\n"
                )
        self.seen = max(self.seen, len(rows))
        self.stream.flush()

    def _loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.poll()

    def __enter__(self) -> Follower:
        self._thread = threading.Thread(target=self._loop, args=(1.0 if self.tty else 0.5,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()  # the last rounds
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def run_with_progress(
    overrides: list[str],
    run_dir: Path | None = None,
    resume: Path | None = None,
    label: str = "",
    stream: TextIO | None = None,
    commands: Any = None,
) -> dict[str, Any]:
    """One job through the launcher (``run_job(..., quiet=True)``) with a progress line; its summary.
    ``commands``: the terms of the resume command its RunInterrupted / RunFailed carry."""
    if resume is not None:
        require_local_run(resume.resolve())  # a run on devices resumes there, not here
        require_checkpoint(resume.resolve())  # refused before anything else
    opts = run_options(resume_config(resume, overrides) if resume is not None else load_config(overrides))
    if resume is not None:
        run_dir = resume
    run_dir = (run_dir or (Path(opts.output_dir) if opts.output_dir else default_run_dir(opts.method.name))).resolve()
    out = stream or sys.stdout
    header = (
        f"{label}{opts.method.name} on {opts.model.arch}/{opts.dataset.name}, {opts.rounds} rounds; "
        f"outputs in {run_dir} (Flower's log: flwr_run.log)\n"
    )
    done = checkpoint_round(run_dir) if resume is not None else None
    extra = FINAL_STATISTICS if opts.evaluation.deploy_stats else ""
    with Follower(run_dir, opts.rounds, out, label=label, done=done, last_extra=extra) as follower:
        return run_job(
            overrides,
            run_dir=run_dir,
            resume=resume,
            quiet=True,
            commands=commands,
            on_error=follower.say,
            on_checked=lambda: out.write(header),  # once the run is accepted: a refusal is its one line
        )
