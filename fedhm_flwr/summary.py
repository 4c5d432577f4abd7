"""Collect finished runs into one table and two plots.

``python -m fedhm_flwr.summary DIR [DIR ...] [--out OUT]``: every DIR is a run directory (holding
``summary.json``) or a folder of them (a Hydra sweep directory); the table gets one row per run
with the values that differ between the runs' resolved configs (the swept values), final and best
accuracy of the global model and of each level, parameters per level, bytes moved and wall time.
Writes ``summary.md``, ``summary.csv``, ``accuracy_by_round.png`` and ``accuracy_vs_bytes.png``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fedhm_flwr.results import CONFIG_FILE, METRICS_JSONL, SUMMARY_FILE, atomic_write

IGNORED = ("output_dir", "dataset.data_dir", "timeout")
# summary keys shown as accuracy columns: the server's test set, then the clients' federated figures
ACC_PREFIXES = ("final_acc/", "best_acc/", "final_fed_acc/", "best_fed_acc/", "final_fed_acc_clients/")


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories among ``paths`` and their subfolders (sorted, deduplicated)."""
    found: list[Path] = []
    for path in paths:
        if (path / SUMMARY_FILE).is_file():
            found.append(path.resolve())
        elif path.is_dir():
            found += sorted(p.parent.resolve() for p in path.rglob(SUMMARY_FILE))
    return sorted(set(found), key=lambda p: (str(p.parent), _job_number(p), p.name))


def _job_number(path: Path) -> int:
    digits = "".join(ch for ch in path.name if ch.isdigit())
    return int(digits) if digits else -1


def _flat_config(run_dir: Path) -> dict[str, Any]:
    cfg = OmegaConf.load(run_dir / CONFIG_FILE)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = json.dumps(node) if isinstance(node, list) else node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def _hydra_overrides(run_dir: Path) -> dict[str, str] | None:
    """A Hydra job's overrides (``.hydra/overrides.yaml``), key -> value as typed; None if absent."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    items = OmegaConf.to_container(OmegaConf.load(path))
    return dict(str(item).lstrip("+~").split("=", 1) for item in items if "=" in str(item))  # type: ignore[union-attr]


def collect(run_dirs: list[Path]) -> tuple[list[str], list[dict[str, Any]]]:
    """(swept keys, one row per run) read from each run's own outputs.

    Swept keys: for Hydra jobs, the overridden keys whose values differ between jobs (a config
    group such as ``method`` shows the option chosen, a value its resolved value in the job's own
    ``config.yaml``); otherwise every key whose resolved value differs between the runs."""
    configs = [_flat_config(d) for d in run_dirs]
    overrides = [_hydra_overrides(d) for d in run_dirs]
    if all(o is not None for o in overrides):
        keys = sorted({k for o in overrides for k in o})  # type: ignore[union-attr]
        values = [{k: (c[k] if k in c else o.get(k)) for k in keys} for c, o in zip(configs, overrides)]  # type: ignore[union-attr]
    else:
        keys = sorted({k for c in configs for k in c})
        values = [{k: c.get(k) for k in keys} for c in configs]
    swept = [k for k in keys if k not in IGNORED and not k.startswith("hydra.")
             and len({json.dumps(v.get(k)) for v in values}) > 1]
    rows = []
    for run_dir, value in zip(run_dirs, values):
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        row: dict[str, Any] = {"run": run_dir.name}
        row.update({k: value.get(k) for k in swept})
        row.setdefault("method", summary.get("method"))  # a swept method group keeps its option name
        for key, value in summary.items():
            if key.startswith(ACC_PREFIXES):
                row[key] = value
        for level, cost in summary.get("level_costs", {}).items():
            row[f"params/level_{level}"] = int(cost.get("params", 0))
        row["bytes_total"] = summary.get("bytes_total")
        row["wall_seconds"] = round(float(summary.get("wall_seconds", 0.0)), 1)
        row["rounds"] = summary.get("rounds_completed")
        row["dir"] = str(run_dir)
        rows.append(row)
    return swept, rows


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Columns in reading order: run, swept values, method, accuracies (global, then levels
    largest first), parameters per level, then the costs."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]

    def level_of(col: str) -> float:
        tail = col.rsplit("level_", 1)
        return -float(tail[1]) if len(tail) == 2 else -float("inf")

    accs = sorted((c for c in cols if c.startswith(ACC_PREFIXES)),
                  key=lambda c: ("fed_" in c, level_of(c), not c.startswith("final")))
    params = sorted((c for c in cols if c.startswith("params/")), key=level_of)
    tail = [c for c in ("bytes_total", "wall_seconds", "rounds", "dir") if c in cols]
    head = [c for c in cols if c not in accs + params + tail]
    return head + accs + params + tail


def markdown_table(rows: list[dict[str, Any]], skip: tuple[str, ...] = ("dir",)) -> str:
    cols = [c for c in _columns(rows) if c not in skip]

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if v < 10 else f"{v:,.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _plots(run_dirs: list[Path], rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run_dir, row in zip(run_dirs, rows):
        series = [json.loads(line) for line in (run_dir / METRICS_JSONL).read_text().splitlines()]
        pts = [(r["round"], r["acc/global"]) for r in series if r.get("acc/global") is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=_label(row))
    ax.set_xlabel("round")
    ax.set_ylabel("global model test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(out / "accuracy_by_round.png", buf.getvalue())

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for row in rows:
        if row.get("final_acc/global") is not None and row.get("bytes_total"):
            ax.scatter(row["bytes_total"] / 1e6, row["final_acc/global"])
            ax.annotate(_label(row), (row["bytes_total"] / 1e6, row["final_acc/global"]), fontsize=7)
    ax.set_xlabel("total bytes moved (MB)")
    ax.set_ylabel("final global model accuracy")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(out / "accuracy_vs_bytes.png", buf.getvalue())


def _label(row: dict[str, Any]) -> str:
    skip = {"run", "method", "dir", "bytes_total", "wall_seconds", "rounds"}
    parts = [f"{k.split('.')[-1]}={v}" for k, v in row.items()
             if k not in skip and not k.startswith(ACC_PREFIXES + ("params/",))]
    return f"{row['run']} " + " ".join(parts) if parts else str(row["run"])


def write_summary(paths: list[Path], out: Path) -> list[dict[str, Any]]:
    """Collect the runs under ``paths`` and write the table and plots into ``out``."""
    run_dirs = find_runs(paths)
    if not run_dirs:
        raise FileNotFoundError(f"no finished run (a folder with {SUMMARY_FILE}) under {[str(p) for p in paths]}")
    _, rows = collect(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "summary.md", markdown_table(rows))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_columns(rows), restval="")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out / "summary.csv", buf.getvalue())
    _plots(run_dirs, rows, out)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhm_flwr.summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="run directories or folders of them")
    parser.add_argument("--out", type=Path, help="where to write the table and plots (default: the first path)")
    args = parser.parse_args(argv)
    try:
        rows = write_summary(args.paths, args.out or args.paths[0])
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
