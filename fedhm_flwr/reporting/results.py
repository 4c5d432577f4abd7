"""Per-run outputs: resolved config, per-round metrics (JSONL + CSV), summary, checkpoint, plot.

Everything is written atomically (a temporary file in the same folder, then ``os.replace``), so
an interrupted run never leaves a partial checkpoint or a truncated table behind; the files get the
usual permissions (0666 less the umask).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import os
import secrets
import shlex
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open  # the format's reader (no torch: the launcher reads checkpoint headers)

if TYPE_CHECKING:  # torch is imported where tensors are handled: the launcher's checks stay light
    import torch

CONFIG_FILE = "config.yaml"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
SUMMARY_FILE = "summary.json"
STATUS_FILE = "status.json"  # the ServerApp's own account: running, completed or failed (with the error)
PLOT_FILE = "accuracy.png"
CHECKPOINT_DIR = "checkpoint"
MODEL_FILE = "global_model.safetensors"
STATE_FILE = "strategy_state.json"
#: the fixed norm statistics of every level's deployable model, from the federated pass at the
#: end of the run (:class:`fedhm_flwr.server.deployment.DeploymentQuery`); metadata names the round
BN_STATS_FILE = "bn_statistics.safetensors"
BEST_DIR = "best"  # checkpoint/best/: the model of the best evaluated round (checkpoint.keep_best)
STATE_KEY = "fedhm_state"  # the strategy state, JSON, in the model file's metadata (one file, one rename)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` via a temporary file and an atomic rename; the file gets the
    permissions ``open()`` gives a new file (0666 less the umask), not ``mkstemp``'s 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temporary(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _new_temporary(path: Path) -> tuple[int, Path]:
    """A new, uniquely named file beside ``path``, opened for writing, created with mode 0666 (the
    kernel applies the umask and any default ACL, as for ``open()``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_status(out_dir: str | Path, status: str, **info: Any) -> None:
    """``status.json``: ``running`` (written when the ServerApp starts), ``completed`` or ``failed``
    (with ``error``, one line), the round reached and when; read by ``fedhm status``."""
    record = {"status": status, "time": dt.datetime.now().isoformat(timespec="seconds"), "pid": os.getpid(), **info}
    atomic_write(Path(out_dir) / STATUS_FILE, json.dumps(record, default=str, indent=1))


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((Path(run_dir) / STATUS_FILE).read_text()))
    except (OSError, ValueError):
        return None


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist") and hasattr(value, "detach"):  # a torch tensor
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value)}")


def _clean(value: Any) -> Any:
    """NaN/Inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def refuse_existing_run(out_dir: str | Path) -> None:
    """A new run never writes over an earlier run's results or checkpoint."""
    folder = Path(out_dir)
    taken = [name for name in (METRICS_JSONL, SUMMARY_FILE, CHECKPOINT_DIR) if (folder / name).exists()]
    if taken:
        raise FileExistsError(
            f"{folder} already holds a run ({', '.join(taken)}); resume it with "
            f"`fedhm resume {shlex.quote(str(folder))}` (under `flwr run`: run-config resume=<dir>), "
            "or choose another run directory (--run-dir)"
        )


_PYPLOT: list[threading.Thread] = []  # the one import of matplotlib's pyplot in the background


def _import_pyplot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot


def _import_pyplot_meanwhile() -> None:
    """Import pyplot (0.6 s here) in a background thread while the next rounds train, once per process,
    so the plot after the last round (:meth:`RunRecorder.plot`) does not add it to the run's end."""
    if not _PYPLOT:
        _PYPLOT.append(threading.Thread(target=_import_pyplot, name="fedhm-import-pyplot", daemon=True))
        _PYPLOT[0].start()


class RunRecorder:
    """Writes one run's outputs into ``out_dir`` (absolute)."""

    def __init__(self, out_dir: str | Path, tracker: Any | None = None) -> None:
        self.out_dir = Path(out_dir).expanduser().resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        # the one tracking hook (fedhm_flwr.reporting.tracking.Tracker: TensorBoard, MLflow): told the config,
        # every round's row and the summary
        self.tracker = tracker

    # -- config and metrics

    def write_config(self, yaml_text: str) -> None:
        atomic_write(self.out_dir / CONFIG_FILE, yaml_text)
        if self.tracker is not None:
            self.tracker.config(yaml_text)

    def load_rows(self, rows: list[dict[str, Any]]) -> None:
        """Start from earlier rows (a resumed run) and rewrite the tables to match them."""
        self.rows = [dict(r) for r in rows]
        self._write_tables()

    def log_round(self, row: Mapping[str, Any]) -> None:
        self.rows.append({k: _clean(v) for k, v in row.items()})
        self._write_tables()
        if self.tracker is not None:
            self.tracker.round(self.rows[-1])
        _import_pyplot_meanwhile()

    def amend_round(self, server_round: int, row: Mapping[str, Any]) -> None:
        """Replace round ``server_round``'s row (a verdict that came later amended it) and rewrite the
        tables, atomically as :meth:`log_round` does; a round not recorded here is left alone."""
        at = [i for i, r in enumerate(self.rows) if r.get("round") == server_round]
        if at:
            self.rows[at[-1]] = {k: _clean(v) for k, v in row.items()}
            self._write_tables()

    def _write_tables(self) -> None:
        jsonl = "".join(json.dumps(r, default=_json_default) + "\n" for r in self.rows)
        atomic_write(self.out_dir / METRICS_JSONL, jsonl)
        columns: list[str] = []
        for r in self.rows:
            columns += [k for k in r if k not in columns]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write(self.out_dir / METRICS_CSV, buf.getvalue())

    # -- checkpoint

    #: seconds spent writing checkpoints in this session (the summary's ``checkpoint_seconds``)
    checkpoint_seconds = 0.0

    def save_checkpoint(self, state: Mapping[str, torch.Tensor], strategy_state: Mapping[str, Any]) -> None:
        """The last checkpoint: ``checkpoint/global_model.safetensors`` holding the model and, in
        its metadata, the strategy state (round, history, method and node state), written to a
        temporary file and renamed over the previous one, so the model and its state change
        together, atomically: a kill at any moment leaves the previous or the new checkpoint,
        whole. ``strategy_state.json`` (the same state, for reading) is written after it."""
        t0 = time.perf_counter()
        text = json.dumps(strategy_state, default=_json_default)
        _save_model(self.out_dir / CHECKPOINT_DIR / MODEL_FILE, state, {STATE_KEY: text})
        atomic_write(self.out_dir / CHECKPOINT_DIR / STATE_FILE, text)
        self.checkpoint_seconds += time.perf_counter() - t0

    def save_best(self, state: Mapping[str, torch.Tensor], row: Mapping[str, Any]) -> bool:
        """``checkpoint.keep_best``: keep the model of the best round so far in ``checkpoint/best/``
        (by the global model's accuracy on the server's test set, else the clients' federated
        accuracy; rounds without either are skipped). The round, the metric and its value are in
        the file's metadata. Returns whether this round's model was written."""
        key = next((k for k in ("acc/global", "fed_acc/all") if row.get(k) is not None), None)
        if key is None:
            return False
        path = self.out_dir / CHECKPOINT_DIR / BEST_DIR / MODEL_FILE
        best = best_checkpoint_info(self.out_dir)
        if best is not None and float(best["value"]) >= float(row[key]):
            return False
        t0 = time.perf_counter()
        _save_model(path, state, {"round": str(row["round"]), "metric": key, "value": repr(float(row[key]))})
        self.checkpoint_seconds += time.perf_counter() - t0
        return True

    def save_bn_statistics(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        """The deployable models' fixed norm statistics beside the checkpoint (atomically)."""
        from safetensors.torch import save

        data = save(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            metadata={k: str(v) for k, v in metadata.items()},
        )
        atomic_write(self.out_dir / CHECKPOINT_DIR / BN_STATS_FILE, data)

    # -- summary and plot

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        atomic_write(self.out_dir / SUMMARY_FILE, json.dumps(summary, default=_json_default, indent=2))
        if self.tracker is not None:
            self.tracker.finish(summary)

    def plot(self, title: str = "") -> Path | None:
        """Accuracy against round: the server's test set (global model and each level, solid) and
        the clients' federated evaluation (all clients and each level, dashed)."""
        keys = [k for k in ("acc/global", "fed_acc/all") if any(r.get(k) is not None for r in self.rows)]
        if not keys:
            return None
        if _PYPLOT:
            _PYPLOT[0].join()
        _import_pyplot()
        import matplotlib.pyplot as plt

        for prefix in ("acc/level_", "fed_acc/level_"):
            keys += sorted(
                {k for r in self.rows for k in r if k.startswith(prefix)}, key=lambda k: -float(k.split("_")[-1])
            )
        colours: dict[str | None, str] = {}  # one colour per level (and one for global/all), shared by the two sources
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key in keys:
            pts = [(r["round"], r[key]) for r in self.rows if r.get(key) is not None]
            clients, level = key.startswith("fed_"), key.split("level_")[-1] if "level_" in key else None
            what = f"level {level}" if level else "global model" if key == "acc/global" else "all clients"
            colour = colours.setdefault(level, f"C{len(colours)}")
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="s" if clients else "o",
                ms=3,
                color=colour,
                ls="--" if clients else "-",
                lw=1.2 if level else 2.2,
                label=f"{'clients (federated)' if clients else 'server test set'}: {what}",
            )
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy (top-1)")
        # matplotlib types the locator as the base Locator (it is a MaxNLocator, which takes integer=)
        ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        atomic_write(self.out_dir / PLOT_FILE, buf.getvalue())
        return self.out_dir / PLOT_FILE


def _save_model(path: Path, state: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written to a temporary file in the same folder, flushed to disk, then
    renamed over ``path`` (atomic)."""
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    atomic_write(path, save(tensors, metadata=metadata))


def _metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata (its header only: no tensor is read, no torch needed)."""
    with safe_open(str(path), framework="numpy") as fh:
        return dict(fh.metadata() or {})


def load_checkpoint_state(run_dir: str | Path) -> dict[str, Any]:
    """The strategy state of a run directory's last checkpoint (round, history, ...), read from
    the model file it belongs to; FileNotFoundError naming the folder when there is none."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    model = folder / MODEL_FILE
    if not model.is_file():
        raise FileNotFoundError(f"no checkpoint in {folder} (expected {MODEL_FILE})")
    text = _metadata(model).get(STATE_KEY)
    if text is None:  # a checkpoint written before the state moved into the model file
        if not (folder / STATE_FILE).is_file():
            raise FileNotFoundError(f"no checkpoint in {folder} (expected {MODEL_FILE} and {STATE_FILE})")
        text = (folder / STATE_FILE).read_text()
    return dict(json.loads(text))


def load_checkpoint(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(global model state, strategy state) of a run directory's last checkpoint."""
    state = load_checkpoint_state(run_dir)
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / CHECKPOINT_DIR / MODEL_FILE)), state


def best_checkpoint_info(run_dir: str | Path) -> dict[str, str] | None:
    """``{"round", "metric", "value"}`` of ``checkpoint/best/`` (checkpoint.keep_best), None if absent."""
    path = Path(run_dir) / CHECKPOINT_DIR / BEST_DIR / MODEL_FILE
    return _metadata(path) if path.is_file() else None


def load_bn_statistics(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """(tensors, metadata) of the run's saved deployment statistics, or None."""
    path = Path(run_dir) / CHECKPOINT_DIR / BN_STATS_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})  # noqa: SIM118  safe_open is not iterable


def summarize(rows: list[dict[str, Any]], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Final and best accuracy on the server's test set (``final_acc/global``, ...: normalised as
    ``extra["bn_stats"]`` says, ``test_batch`` by default), the final **deployable** accuracy
    (``final_deployable_acc/global``, ``final_deployable_acc/level_<γ>``: with the statistics the
    exported model carries, ``deployable_bn_stats``; measured once, after the last round) and the
    clients' federated evaluation (``final_fed_acc/all``, ..., final spread
    ``final_fed_acc_clients/mean|std|worst10``), bytes moved (evaluation included), failures."""
    out: dict[str, Any] = dict(extra)
    prefixes = ("acc/", "deployable_acc/", "fed_acc/", "fed_acc_clients/")
    for key in sorted({k for r in rows for k in r if k.startswith(prefixes)}):
        series = [r[key] for r in rows if r.get(key) is not None]
        if series:
            out[f"final_{key}"] = series[-1]
            if not key.startswith(("fed_acc_clients/", "deployable_acc/")):
                out[f"best_{key}"] = max(series)
    out["rounds_completed"] = len(rows)
    out["bytes_sent"] = int(sum(r.get("bytes_sent", 0) for r in rows))
    out["bytes_received"] = int(sum(r.get("bytes_received", 0) for r in rows))
    out["bytes_bn_stats"] = int(sum(r.get("bytes_bn_stats", 0) for r in rows))
    out["bytes_eval"] = int(sum(r.get("bytes_eval_sent", 0) + r.get("bytes_eval_received", 0) for r in rows))
    # node-info queries of the rounds and of the start-up before round 1 (``startup_bytes``)
    out["bytes_queries"] = int(sum(r.get("bytes_queries", 0) for r in rows) + out.get("startup_bytes", 0))
    out["bytes_total"] = (
        out["bytes_sent"] + out["bytes_received"] + out["bytes_bn_stats"] + out["bytes_eval"] + out["bytes_queries"]
    )
    out["failures"] = int(sum(r.get("failures", 0) for r in rows))
    out["rejected"] = int(sum(r.get("rejected", 0) for r in rows))
    out["fed_failures"] = int(sum(r.get("fed_failures", 0) for r in rows))
    # nodes that sat out (their data could not serve the run) -> why, as the last round that saw them said
    out["excluded"] = {label: why for r in rows for label, why in json.loads(r.get("excluded") or "{}").items()}
    out["seconds_rounds"] = float(sum(r.get("seconds", 0.0) for r in rows))
    return out
