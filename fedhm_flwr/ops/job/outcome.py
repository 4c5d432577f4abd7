"""How a run ends, in the user's terms: the command that resumes it, :class:`RunInterrupted`,
:class:`RunFailed`, the exit code an entry point returns after an interrupt, and the last line
and exit code of a finished run (:func:`finished`: collapsed, diverged, nothing accepted).

Every entry point (``fedhm run|resume|sweep|compare|deploy-local``, ``make run``,
``python -m fedhm_flwr.ops.job.launch``, :mod:`fedhm_flwr.api`) reports an interrupted or failed run
with the resume command in the terms the user started it with (:class:`Commands`).
"""

from __future__ import annotations

import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhm_flwr.config import ConfigError
from fedhm_flwr.ops.deploy.device_run import resume_refusal
from fedhm_flwr.ops.deploy.supernode import (  # a process's exit in words; the wrapper imports nothing
    exit_status as exit_status,
)
from fedhm_flwr.ops.job.health import final_line
from fedhm_flwr.ops.job.signals import Interrupted, on_signals
from fedhm_flwr.reporting.results import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    METRICS_JSONL,
    STATUS_FILE,
    load_checkpoint_state,
    refuse_existing_run,
)


@dataclass(frozen=True)
class Commands:
    """What the user types to resume a run (``resume`` + the run directory) or to start it again
    (``start`` + the overrides + ``--run-dir`` the run directory), in the terms they started it
    with: ``fedhm resume DIR`` after ``fedhm run`` / ``make run``, ``python -m fedhm_flwr.ops.job.launch
    --resume DIR`` after that module, ``fedhm deploy-local ... --resume DIR`` after a local deployment.
    ``cwd``: a folder to change to first (``python -m`` of a checkout that is not installed)."""

    resume: tuple[str, ...]
    start: tuple[str, ...]
    cwd: Path | None = None

    def _line(self, words: Sequence[str]) -> str:
        return (f"cd {shlex.quote(str(self.cwd))} && " if self.cwd else "") + shlex.join(words)

    def resume_line(self, run_dir: Path) -> str:
        return self._line([*self.resume, str(run_dir)])

    def start_line(self, overrides: Sequence[str], run_dir: Path | None) -> str:
        return self._line([*self.start, *overrides, *(["--run-dir", str(run_dir)] if run_dir else [])])


class PythonCommands(Commands):
    """The Python API's terms: ``fedhm_flwr.api.resume(DIR)`` / ``fedhm_flwr.api.run([...], run_dir=DIR)``."""

    def resume_line(self, run_dir: Path) -> str:
        return f"fedhm_flwr.api.resume({str(run_dir)!r})"

    def start_line(self, overrides: Sequence[str], run_dir: Path | None) -> str:
        return f"fedhm_flwr.api.run({list(overrides)!r}" + (f", run_dir={str(run_dir)!r})" if run_dir else ")")


def fedhm_program() -> tuple[str, ...]:
    """How to call this environment's ``fedhm`` command: ``fedhm`` when that is what the shell
    finds, else the script's absolute path (a virtualenv that is not activated, ``make``), else
    ``python -m fedhm_flwr``."""
    script = Path(sys.executable).parent / "fedhm"
    found = shutil.which("fedhm")
    if script.is_file():
        return ("fedhm",) if found and Path(found).resolve() == script.resolve() else (str(script),)
    return (sys.executable, "-m", "fedhm_flwr")


def fedhm_commands() -> Commands:
    """``fedhm resume DIR`` / ``fedhm run ... --run-dir DIR`` (``fedhm run``, ``make run``)."""
    program = fedhm_program()
    return Commands((*program, "resume"), (*program, "run"))


def checkpoint_round(run_dir: Path) -> int | None:
    """The round of the run directory's last complete checkpoint, None if there is none."""
    try:
        return int(load_checkpoint_state(run_dir)["round"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def resume_hint(run_dir: Path, commands: Commands, overrides: Sequence[str]) -> tuple[str, str | None, int | None]:
    """(what to type to continue the run, the resume command or None, the checkpoint's round or None).

    Without a checkpoint: the command that starts the run again (into the same directory when
    nothing of it is there yet)."""
    saved = checkpoint_round(run_dir)
    if saved is None:
        try:
            refuse_existing_run(run_dir)
            again = commands.start_line(overrides, run_dir)
        except FileExistsError:  # rows but no checkpoint (checkpoint.every > rounds done): a new directory
            again = commands.start_line(overrides, None)
        return (
            f"no checkpoint was written yet, so there is nothing to resume; start the run again with:\n  {again}",
            None,
            None,
        )
    command = commands.resume_line(run_dir)
    return (
        f"the last complete checkpoint (round {saved}) is in {run_dir / CHECKPOINT_DIR}; "
        f"resume the run with:\n  {command}",
        command,
        saved,
    )


class RunInterrupted(Interrupted):
    """A run stopped by SIGINT / SIGTERM / SIGHUP, raised once every process it started is gone.

    ``run_dir``; ``checkpoint_round`` (the last complete checkpoint, None when none was written);
    ``resume_command`` (what continues it, in the caller's terms; None without a checkpoint);
    ``exit_code`` 128 + the signal number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP). ``str()`` is
    the report the commands print. A :class:`KeyboardInterrupt`, as an interrupt should be."""

    def __init__(
        self, signum: int, run_dir: Path, hint: str, resume_command: str | None, checkpoint_round: int | None
    ) -> None:
        super().__init__(signum)
        self.run_dir, self.hint = run_dir, hint
        self.resume_command, self.checkpoint_round = resume_command, checkpoint_round

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"{name} received: stopped the Flower run and every process it started.\n{self.hint}"


class RunFailed(RuntimeError):
    """A run that did not complete: ``run_dir``, ``reason`` (one line: the ServerApp's exception
    and/or the first client error found in Flower's output, or the process of the job that died;
    None if none of that is known), ``log`` (Flower's output), ``resume_command`` (None without a
    checkpoint), ``details`` (e.g. the last lines of a dead process's log). ``str()`` ends with the
    reason's line, then the details."""

    def __init__(
        self,
        message: str,
        run_dir: Path | None = None,
        reason: str | None = None,
        log: Path | None = None,
        resume_command: str | None = None,
        details: str | None = None,
    ) -> None:
        self.message, self.run_dir, self.reason, self.log = message, run_dir, reason, log
        self.resume_command, self.details = resume_command, details
        super().__init__(message)

    def __str__(self) -> str:
        lines = [self.message]
        if self.resume_command:
            lines.append(f"after fixing the cause, resume the run from its last checkpoint with: {self.resume_command}")
        lines.append(f"why: {self.reason}" if self.reason else f"why: Flower's output names no error; see {self.log}")
        if self.details:
            lines.append(self.details)
        return "\n".join(lines)


def interrupted(stop: Interrupted, run_dir: Path, commands: Commands, overrides: Sequence[str]) -> RunInterrupted:
    """The :class:`RunInterrupted` of a run whose processes are all stopped."""
    hint, command, saved = resume_hint(run_dir, commands, overrides)
    return RunInterrupted(stop.signum, run_dir, hint, command, saved)


def require_local_run(run_dir: Path) -> None:
    """A run that ran on devices is resumed on its devices, never finished here as a local simulation on
    this machine's data: refused (ConfigError naming the folder and the command that resumes it on its
    devices, :func:`fedhm_flwr.ops.deploy.device_run.resume_refusal`) before anything starts."""
    if refusal := resume_refusal(run_dir):
        raise ConfigError("resume", str(run_dir), f"a run of a simulation on this machine: {refusal}")


def require_checkpoint(run_dir: Path) -> None:
    """A resume needs a run directory with a checkpoint: refused (ConfigError naming the folder and
    what is missing) before anything starts: a folder that does not exist, one that holds no run
    (none of ``config.yaml``, ``status.json``, ``metrics.jsonl``, ``checkpoint/``), a run that stopped
    before its first checkpoint."""
    if checkpoint_round(run_dir) is not None:
        return
    marks = (CONFIG_FILE, STATUS_FILE, METRICS_JSONL, CHECKPOINT_DIR)
    if not run_dir.is_dir():
        raise ConfigError(
            "resume",
            str(run_dir),
            "the directory of a run (e.g. outputs/<date>/<time>-<method>): this folder does not exist",
        )
    if not any((run_dir / name).exists() for name in marks):
        raise ConfigError(
            "resume",
            str(run_dir),
            "the directory of a run (e.g. outputs/<date>/<time>-<method>): "
            f"this folder is not a run (it holds none of {', '.join(marks)}); start a run with "
            "`fedhm run`, or give the folder a run wrote",
        )
    raise ConfigError(
        "resume",
        str(run_dir),
        f"a run directory with a checkpoint ({run_dir / CHECKPOINT_DIR} "
        "holds none: the run stopped before its first one): start it again",
    )


def report_stop(stop: KeyboardInterrupt) -> int:
    """After an interrupt: the report (stderr) and the exit code, 128 + the signal number."""
    if isinstance(stop, RunInterrupted):
        print(f"\n{stop}", file=sys.stderr, flush=True)
    elif isinstance(stop, Interrupted):
        print(
            f"\n{signal.Signals(stop.signum).name} received before the run started: nothing was started.",
            file=sys.stderr,
            flush=True,
        )
    return stop.exit_code if isinstance(stop, Interrupted) else 130


def finished(summary: Mapping[str, Any]) -> tuple[int, str]:
    """(exit code, the line a command ends a finished run with): the final accuracy and where the
    outputs are, with what the run's records say of its model (:mod:`fedhm_flwr.ops.job.health`): a
    collapse is said after it (exit 0); a diverged run, or one that accepted no reply, ends
    ``error: ...`` with a hint (exit 1)."""
    return final_line(summary)


def report_finished(summary: Mapping[str, Any], prefix: str = "", suffix: str = "") -> int:
    """Print :func:`finished`'s line (stdout; stderr for an error) between ``prefix`` and ``suffix``;
    return its exit code."""
    code, line = finished(summary)
    print(f"{prefix}{line}{suffix}", file=sys.stderr if code else sys.stdout, flush=True)
    return code


def run_command(
    job: Callable[[], Mapping[str, Any]],
    refused: tuple[type[Exception], ...] = (ConfigError, FileExistsError),
) -> tuple[int, Mapping[str, Any] | None]:
    """A command's job under the one signal handler, as (exit code, its summary or None): 0 when it
    ended; 2 when it was refused before anything ran (``refused``: a bad config, a used or locked run
    directory); 1 when it failed (:class:`RunFailed`, ending with the line that says why); 128 + the
    signal number on an interrupt, after the report and the resume command (:func:`report_stop`)."""
    try:
        with on_signals():  # SIGINT / SIGTERM / SIGHUP from here on: a clean stop
            return 0, job()
    except refused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2, None
    except RuntimeError as err:  # RunFailed
        print(f"error: {err}", file=sys.stderr)
        return 1, None
    except KeyboardInterrupt as stop:  # RunInterrupted (everything stopped), or before the start
        return report_stop(stop), None
