"""Runs tracked where researchers look: TensorBoard (default, offline) and MLflow (optional).

:class:`RunRecorder <fedhm_flwr.reporting.results.RunRecorder>` calls one hook, a :class:`Tracker`, with
the resolved config (``config``), every round's row (``round``) and the run's summary at the end
(``finish``). Every numeric key of a round's row becomes a scalar at step ``round`` (global and
per-level accuracy and loss, federated ``fed_*`` figures when present, bytes, seconds,
failures); the resolved config becomes hparams (TensorBoard) or params (MLflow).

Config (``tracking.*``): ``tensorboard`` (default true: event files in ``<run dir>/tb``, so
``tensorboard --logdir outputs`` shows a sweep side by side), ``mlflow`` (default false; needs
the ``[mlflow]`` extra, ``mlflow-skinny``), ``mlflow_uri`` (null: a file store in
``<run dir>/mlruns``), ``experiment`` (the MLflow experiment name). No Flower import here.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

TB_DIR = "tb"
MLFLOW_DIR = "mlruns"
MLFLOW_RUN_FILE = "mlflow_run.json"  # in the run directory: where its MLflow run is
#: the metrics the TensorBoard hparams table shows next to each run's config
HPARAM_METRICS = ("acc/global", "loss/global")


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of one round's row (booleans, strings, None and NaN/Inf left out)."""
    out = {}
    for key, value in row.items():
        if key == "round" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"a.b": value}`` with scalar values (lists and None as JSON text)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


class Tracker:
    """The hook :class:`~fedhm_flwr.reporting.results.RunRecorder` calls; this base tracks nothing."""

    def config(self, yaml_text: str) -> None:
        """The resolved configuration (once, at the start of a run or a resumed run)."""

    def round(self, row: Mapping[str, Any]) -> None:
        """One round's row (as written to ``metrics.jsonl``)."""

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The run's summary; the tracker closes."""


class TensorBoardTracker(Tracker):
    """Event files in ``<out_dir>/tb``: scalars per round, the config as hparams and text."""

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / TB_DIR))

    def config(self, yaml_text: str) -> None:
        from torch.utils.tensorboard.summary import hparams

        hp = flat_config(yaml.safe_load(yaml_text) or {})
        # written into this run's own event file (SummaryWriter.add_hparams would start a sub-run)
        # (torch leaves hparams untyped, and types file_writer by the None it starts as)
        for item in hparams(hp, {name: 0.0 for name in HPARAM_METRICS}):  # type: ignore[no-untyped-call]
            self.writer.file_writer.add_summary(item)  # type: ignore[attr-defined]
        self.writer.add_text("config", "```\n" + yaml_text + "\n```")
        self.writer.flush()

    def round(self, row: Mapping[str, Any]) -> None:
        step = int(row["round"])
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.writer.close()


class MlflowTracker(Tracker):
    """One MLflow run: the same scalars as metrics (step = round), the config as params."""

    def __init__(self, out_dir: Path, uri: str | None, experiment: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RuntimeError(
                "tracking.mlflow=true needs MLflow: pip install 'fedhm-flwr[mlflow]' (mlflow-skinny)"
            ) from None
        if not uri:
            uri = (Path(out_dir) / MLFLOW_DIR).resolve().as_uri()
            # MLflow 3 keeps its file store only on request; a store in the run directory is offline
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        record = Path(out_dir) / MLFLOW_RUN_FILE
        earlier = json.loads(record.read_text()) if record.is_file() else {}
        self.resumed = earlier.get("tracking_uri") == uri
        if self.resumed:  # a resumed run goes on in its MLflow run
            self.run_id = earlier["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=Path(out_dir).name).info.run_id
            record.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))

    def config(self, yaml_text: str) -> None:
        from mlflow.entities import Param

        if self.resumed:  # params are immutable in MLflow; the config of the resumed run is logged as text
            self.client.log_text(self.run_id, yaml_text, f"config-resumed-{int(time.time())}.yaml")
            return
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(yaml.safe_load(yaml_text) or {}).items()]
        for start in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_text(self.run_id, yaml_text, "config.yaml")

    def round(self, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["round"])
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in scalars(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, ``_ - . / :`` and spaces in metric names (TensorBoard's tags are kept)."""
    return "".join(ch if ch.isalnum() or ch in "_-./: " else "_" for ch in key)


class Trackers(Tracker):
    """Several trackers behind the one hook."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def config(self, yaml_text: str) -> None:
        for t in self.trackers:
            t.config(yaml_text)

    def round(self, row: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.round(row)

    def finish(self, summary: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.finish(summary)


def open_tracker(tracking: Mapping[str, Any] | None, out_dir: str | Path) -> Tracker:
    """The trackers a run's ``tracking`` config section asks for (a missing section: TensorBoard)."""
    tracking = dict(tracking or {})
    out = Path(out_dir)
    chosen: list[Tracker] = []
    if tracking.get("tensorboard", True):
        chosen.append(TensorBoardTracker(out))
    if tracking.get("mlflow", False):
        chosen.append(MlflowTracker(out, tracking.get("mlflow_uri"), str(tracking.get("experiment") or "fedhm")))
    return Trackers(chosen)
