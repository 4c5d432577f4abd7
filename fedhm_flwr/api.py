"""Python API: run a job from a script or a notebook.

    from fedhm_flwr.api import run
    result = run(["rounds=1", "levels.ratios=[1,0.25]"])
    result.final_accuracy, result.level_accuracy, result.run_dir, result.summary

:func:`run` goes through the same launcher as ``fedhm run`` / ``python -m fedhm_flwr.launch`` (a
private SuperLink, ``flwr run`` on the Ray simulation engine, a status check, cleanup), quietly:
Flower's output goes to ``<run dir>/flwr_run.log``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhm_flwr.config import split_overrides
from fedhm_flwr.results import SUMMARY_FILE


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
        return {k[len(prefix):]: v for k, v in self.summary.items() if k.startswith(prefix)}

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Summary:
        return cls(Path(summary["output_dir"]), summary.get("final_acc/global"), dict(summary))


def run(overrides: str | Sequence[str] | None = None, run_dir: str | Path | None = None,
        progress: bool = False) -> Summary:
    """Run one job (Hydra overrides as a list or one string); ``run_dir`` defaults to
    ``outputs/<date>/<time>-<method>``. ``progress=True`` prints the progress line meanwhile.
    Raises :class:`~fedhm_flwr.config.ConfigError` on a bad value, before anything starts."""
    items = split_overrides(overrides)
    target = Path(run_dir).expanduser().resolve() if run_dir is not None else None
    if progress:
        from fedhm_flwr.progress import run_with_progress

        return Summary.from_summary(run_with_progress(items, run_dir=target))
    from fedhm_flwr.launch import run_job

    return Summary.from_summary(run_job(items, run_dir=target, quiet=True))


def resume(run_dir: str | Path, overrides: str | Sequence[str] | None = None, progress: bool = False) -> Summary:
    """Continue the run stored in ``run_dir`` (``rounds=N`` extends it)."""
    items, target = split_overrides(overrides), Path(run_dir).expanduser().resolve()
    if progress:
        from fedhm_flwr.progress import run_with_progress

        return Summary.from_summary(run_with_progress(items, resume=target))
    from fedhm_flwr.launch import run_job

    return Summary.from_summary(run_job(items, resume=target, quiet=True))


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
    from fedhm_flwr.export import deployable_model  # torch: only where a model is asked for

    return deployable_model(Path(run_dir).expanduser().resolve(), level)[3]
