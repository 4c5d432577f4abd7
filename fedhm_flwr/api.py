"""Python API: run a job from a script or a notebook.

    from fedhm_flwr.api import run
    result = run(["rounds=1", "levels.ratios=[1,0.25]"])
    result.final_accuracy, result.level_accuracy, result.run_dir, result.summary

:func:`run` goes through the same launcher as ``fedhm run`` / ``python -m fedhm_flwr.ops.job.launch`` (a
private SuperLink, ``flwr run`` on the Ray simulation engine, a status check, cleanup), quietly:
Flower's output goes to ``<run dir>/flwr_run.log``.

How a run that does not complete ends, for ``try``/``except`` in a script:

* :class:`RunInterrupted` (a :class:`KeyboardInterrupt`): SIGINT (a notebook's interrupt, Ctrl-C),
  SIGTERM or SIGHUP arrived; every process of the run was stopped first. ``.run_dir``,
  ``.checkpoint_round`` (None when none was written), ``.resume_command``
  (``fedhm_flwr.api.resume('<run dir>')``, None without a checkpoint), ``.exit_code``;
* :class:`RunFailed` (a :class:`RuntimeError`): the run failed. ``.run_dir``, ``.reason`` (one
  line: the ServerApp's exception and/or the first client error in Flower's output), ``.log``,
  ``.resume_command`` (None without a checkpoint);
* :class:`~fedhm_flwr.config.ConfigError` / :class:`FileExistsError`: refused before anything started.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhm_flwr.config import split_overrides
from fedhm_flwr.ops.job.launch import run_job
from fedhm_flwr.ops.job.outcome import PythonCommands, RunFailed, RunInterrupted
from fedhm_flwr.ops.job.progress import run_with_progress
from fedhm_flwr.ops.job.signals import on_signals
from fedhm_flwr.reporting.results import SUMMARY_FILE

__all__ = ["RunFailed", "RunInterrupted", "Summary", "load", "resume", "run"]


@dataclass(frozen=True)
class Summary:
    """A finished run: its directory, the final global accuracy and the whole ``summary.json``."""

    run_dir: Path
    final_accuracy: float | None
    summary: dict[str, Any] = field(repr=False)

    @property
    def level_accuracy(self) -> dict[str, float]:
        """Final accuracy of each level's deployable model, level (``"0.125"``) -> accuracy."""
        prefix = "final_acc/level_"
        return {k[len(prefix) :]: v for k, v in self.summary.items() if k.startswith(prefix)}

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Summary:
        return cls(Path(summary["output_dir"]), summary.get("final_acc/global"), dict(summary))


#: how the exceptions name the calls that continue or restart a run
API_COMMANDS = PythonCommands(("fedhm_flwr.api.resume",), ("fedhm_flwr.api.run",))


def _launch(items: list[str], run_dir: Path | None, resume: Path | None, progress: bool) -> Summary:
    with on_signals():  # SIGINT / SIGTERM / SIGHUP -> RunInterrupted once everything is stopped
        if progress:
            return Summary.from_summary(run_with_progress(items, run_dir=run_dir, resume=resume, commands=API_COMMANDS))
        return Summary.from_summary(run_job(items, run_dir=run_dir, resume=resume, quiet=True, commands=API_COMMANDS))


def run(
    overrides: str | Sequence[str] | None = None, run_dir: str | Path | None = None, progress: bool = False
) -> Summary:
    """Run one job (Hydra overrides as a list or one string); ``run_dir`` defaults to
    ``outputs/<date>/<time>-<method>``. ``progress=True`` prints the progress line meanwhile.
    Raises :class:`~fedhm_flwr.config.ConfigError` on a bad value, before anything starts;
    :class:`RunInterrupted` on SIGINT / SIGTERM / SIGHUP and :class:`RunFailed` when the run fails
    (see the module's docstring)."""
    target = Path(run_dir).expanduser().resolve() if run_dir is not None else None
    return _launch(split_overrides(overrides), target, None, progress)


def resume(run_dir: str | Path, overrides: str | Sequence[str] | None = None, progress: bool = False) -> Summary:
    """Continue the run stored in ``run_dir`` (``rounds=N`` extends it); refused with a
    ConfigError naming the folder when it holds no checkpoint, or when it ran on devices (``fedhm
    deploy-local``, ``flwr run`` on a federation: the error names the command that resumes it on its
    devices; as ``fedhm resume``). Raises as :func:`run` does."""
    return _launch(split_overrides(overrides), None, Path(run_dir).expanduser().resolve(), progress)


def load(run_dir: str | Path) -> Summary:
    """The summary of a finished run directory."""
    path = Path(run_dir).expanduser().resolve() / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a finished run directory")
    return Summary.from_summary(json.loads(path.read_text()))


def load_model(run_dir: str | Path, level: str | float = 1) -> Any:
    """A run's deployable model of ``level`` (``1``, ``0.125``, ``"1/8"``), as ``fedhm export``
    writes it: in eval mode with fixed normalisation statistics, so its predictions do not depend
    on the batch (docs/METHODS.md#deployable-statistics)."""
    from fedhm_flwr.ops.tools.export import deployable_model  # torch: only where a model is asked for

    return deployable_model(Path(run_dir).expanduser().resolve(), level)[4]
