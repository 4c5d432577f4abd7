"""Collect finished runs into tables over seeds and plots.

``python -m fedhm_flwr.reporting.summary DIR [DIR ...] [--out OUT] [--reference METHOD]``: every DIR is a
run directory (holding ``summary.json``) or a folder of them (a Hydra sweep directory).

* ``summary.md`` / ``summary.csv``: one row per run with the values that differ between the runs'
  resolved configs (the swept values), final, best and last-10 % accuracy of the global model and
  of each level, parameters per level (and FedHM's at the same level for budget-matched runs),
  bytes moved and wall time.
* ``statistics.md`` / ``statistics.csv``: runs grouped by their configuration without the seed;
  per group and per model (global, each level): n, mean ± std and the 95 % Student-t confidence
  interval of the final accuracy and of the mean accuracy over the last 10 % of rounds.
* ``paired.csv`` (and in ``statistics.md``): per setting (the configuration without seed, method
  and method options), the per-seed difference of every method against ``--reference`` (default
  ``fedhm``) on the same seed, with its mean and 95 % confidence interval. A swept method option
  (``method.*``, ``train.distill.*``: an ablation such as ``train.distill.enabled=true``) that is on
  is part of the method's name (``fedhm train.distill.enabled=True``), so an ablation is paired
  with the plain method like any other method.
* plots: ``accuracy_by_round.png`` (mean curve per configuration, band = 95 % CI over seeds),
  ``accuracy_vs_bytes.png`` (final global accuracy against cumulative bytes moved),
  ``accuracy_vs_params.png``, ``accuracy_vs_macs.png`` and ``accuracy_vs_memory.png`` (final
  accuracy of each level's model against its parameters / MACs / estimated training memory,
  :func:`fedhm_flwr.models.costs.training_memory_bytes`); error bars are the 95 % CIs over seeds.

:func:`write_summary` is the function a results page builds on: it tabulates whatever finished
run directories it is given. The statistics over seeds live in :mod:`fedhm_flwr.reporting.summary_stats`, the
plots in :mod:`fedhm_flwr.reporting.summary_plots`.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from fedhm_flwr.reporting.results import CONFIG_FILE, SUMMARY_FILE, atomic_write
from fedhm_flwr.reporting.summary_plots import write_plots

# the statistics over seeds (paired_differences, seed_statistics, tail_accuracies are also imported from here)
from fedhm_flwr.reporting.summary_stats import (
    COSTS,
    METHOD_OPTIONS,
    paired_differences,
    read_metrics,
    seed_statistics,
    statistics_markdown,
    tail_accuracies,
)

IGNORED = ("output_dir", "dataset.data_dir", "timeout")
# summary keys shown as accuracy columns: the server's test set (test-batch or federated statistics, then the
# deployable figure: the exported model's statistics), then the clients' federated figures
ACC_PREFIXES = (
    "final_acc/",
    "best_acc/",
    "final_deployable_acc/",
    "final_fed_acc/",
    "best_fed_acc/",
    "final_fed_acc_clients/",
)


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


def saved_config(run_dir: Path) -> Any:
    """A run's saved ``config.yaml`` as a read-only DictConfig, parsed once per version of the file (its path,
    size and modification time): a results page reads each run's config in several places, and parsing the
    YAML was a good part of writing the page."""
    path = (Path(run_dir) / CONFIG_FILE).resolve()
    stat = path.stat()
    return _parsed_config(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _parsed_config(path: Path, size: int, mtime_ns: int) -> Any:
    cfg = OmegaConf.load(path)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _flat_config(run_dir: Path) -> dict[str, Any]:
    cfg = saved_config(run_dir)
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
    items = cast("list[Any]", OmegaConf.to_container(OmegaConf.load(path)))  # overrides.yaml holds a list
    pairs = (str(item).lstrip("+~").split("=", 1) for item in items if "=" in str(item))
    return dict(cast("Iterable[tuple[str, str]]", pairs))  # [key, value] lists: dict takes any pair


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
    swept = [
        k
        for k in keys
        if k not in IGNORED and not k.startswith("hydra.") and len({json.dumps(v.get(k)) for v in values}) > 1
    ]
    rows = []
    for run_dir, value, config in zip(run_dirs, values, configs):
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        row: dict[str, Any] = {"run": run_dir.name}
        row.update({k: value.get(k) for k in swept})
        row.setdefault("method", summary.get("method"))  # a swept method group keeps its option name
        row.setdefault("seed", config.get("seed"))
        for key, value in summary.items():
            if key.startswith(ACC_PREFIXES):
                row[key] = value
        row.update(tail_accuracies(read_metrics(run_dir)))
        for level, cost in summary.get("level_costs", {}).items():
            for name in COSTS:
                if name in cost:
                    row[f"{name}/level_{level}"] = int(cost[name])
        row["bytes_total"] = summary.get("bytes_total")
        row["wall_seconds"] = round(float(summary.get("wall_seconds", 0.0)), 1)
        row["rounds"] = summary.get("rounds_completed")
        row["dir"] = str(run_dir)
        rows.append(row)
    options = ablation_keys(swept, rows)
    for row in rows:
        row["method"] = method_label(row, options)
    return swept, rows


def ablation_keys(swept: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """Swept method options (``method.*``, ``train.distill.*``) that take more than one value among
    the runs of one method (an option that differs only because the methods differ is not one)."""
    out = []
    for key in swept:
        if key.startswith(METHOD_OPTIONS) and key != "method.name":
            by_method: dict[str, set[str]] = {}
            for row in rows:
                by_method.setdefault(str(row.get("method")), set()).add(json.dumps(row.get(key), default=str))
            if any(len(values) > 1 for values in by_method.values()):
                out.append(key)
    return out


def method_label(row: dict[str, Any], options: list[str]) -> str:
    """The method's name with the ablation options the run turned on (``fedhm
    train.distill.enabled=True``); options that are off (false, none, absent) are not named, so
    the plain method keeps its plain name and is the reference of the paired differences."""
    named = [f"{k}={row[k]}" for k in options if row.get(k) not in (None, False, "none", "false", "False")]
    return " ".join([str(row.get("method")), *named])


def _csv(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    cols = columns or list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Columns in reading order: run, swept values, method, accuracies (global, then levels
    largest first), parameters per level, then the costs."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]

    def level_of(col: str) -> float:
        tail = col.rsplit("level_", 1)
        return -float(tail[1]) if len(tail) == 2 else -float("inf")

    kinds = ("final_acc/", "best_acc/", "tail_acc/", "final_fed_acc/", "best_fed_acc/", "final_fed_acc_clients/")
    accs = sorted(
        (c for c in cols if c.startswith(kinds)),
        key=lambda c: ("fed_" in c, level_of(c), [c.startswith(k) for k in kinds].index(True)),
    )
    costs = tuple(f"{c}/" for c in COSTS)
    params = sorted(
        (c for c in cols if c.startswith(costs)),
        key=lambda c: ([c.startswith(k) for k in costs].index(True), level_of(c)),
    )
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


#: the widest a cell of the console tables gets (the files hold every value whole)
CELL_WIDTH = 32


def _plain_table(header: list[str], body: list[list[str]]) -> str:
    """Columns aligned with two spaces, numbers to the right, every cell at most :data:`CELL_WIDTH`."""
    cut = [[c if len(c) <= CELL_WIDTH else c[: CELL_WIDTH - 1] + "…" for c in row] for row in [header, *body]]
    widths = [max(len(row[i]) for row in cut) for i in range(len(header))]
    numeric = [
        all(r[i].replace(".", "").replace(",", "").isdigit() or not r[i] for r in cut[1:]) for i in range(len(header))
    ]
    lines = [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip() for row in cut
    ]
    return "\n".join(lines) + "\n"


def console_report(rows: list[dict[str, Any]], out: Path) -> str:
    """What ``fedhm summary`` and ``fedhm compare`` print, once, readable in a terminal: per run its
    method (with the ablation options it turned on), seed, other swept values, final accuracy of the
    global model and of each level, megabytes moved and wall time; per configuration the mean final
    accuracy of the global model over its seeds with the 95 % CI; and where the full tables are."""
    columns = _columns(rows)
    swept = [c for c in columns[: columns.index("method")] if c != "run" and not c.startswith(METHOD_OPTIONS)]
    accs = [c for c in columns if c.startswith("final_acc/")]
    names = [
        "method",
        "seed",
        *[c for c in swept if c != "seed"],
        *[c.replace("final_acc/", "acc ").replace("level_", "") for c in accs],
        "MB",
        "seconds",
    ]

    def number(value: Any, digits: str) -> str:
        return "" if value is None else format(value, digits)

    body = [
        [str(r.get("method")), str(r.get("seed"))]
        + [str(r.get(c, "")) for c in swept if c != "seed"]
        + [number(r.get(c), ".4f") for c in accs]
        + [
            number(None if r.get("bytes_total") is None else r["bytes_total"] / 1e6, ",.1f"),
            number(r.get("wall_seconds"), ",.0f"),
        ]
        for r in rows
    ]
    text = f"{len(rows)} run(s), final accuracy on the server's test set:\n" + _plain_table(names, body)
    stats_file = out / "statistics.csv"
    stats = list(csv.DictReader(io.StringIO(stats_file.read_text()))) if stats_file.is_file() else []
    over = [s for s in stats if s.get("model") == "global" and int(s.get("n") or 0) > 1]
    if over:
        keys = [k for k in stats[0] if k not in ("model", "n") and not k.startswith(METHOD_OPTIONS)]
        keys = keys[: keys.index("seeds")] if "seeds" in keys else keys
        lines = [
            [
                *(str(s[k]) for k in keys),
                s["n"],
                f"{float(s['final_mean']):.4f}",
                f"[{float(s['final_ci_low']):.4f}, {float(s['final_ci_high']):.4f}]",
            ]
            for s in over
        ]
        text += "\nover seeds, final global accuracy:\n" + _plain_table([*keys, "seeds", "mean", "95 % CI"], lines)
    return text + f"\nevery column: {out / 'summary.md'}\nover seeds and paired: {out / 'statistics.md'}\n"


def write_summary(paths: list[Path], out: Path, reference: str = "fedhm") -> list[dict[str, Any]]:
    """Collect the finished runs under ``paths`` and write the per-run table, the statistics over
    seeds, the paired differences against ``reference`` and the plots into ``out``."""
    run_dirs = find_runs(paths)
    if not run_dirs:
        raise FileNotFoundError(f"no finished run (a folder with {SUMMARY_FILE}) under {[str(p) for p in paths]}")
    swept, rows = collect(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "summary.md", markdown_table(rows))
    atomic_write(out / "summary.csv", _csv(rows, _columns(rows)))
    stats, paired = seed_statistics(swept, rows), paired_differences(swept, rows, reference)
    atomic_write(out / "statistics.md", statistics_markdown(stats, paired, reference))
    atomic_write(out / "statistics.csv", _csv(stats) if stats else "")
    atomic_write(out / "paired.csv", _csv(paired) if paired else "")
    write_plots(swept, rows, out)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedhm_flwr.reporting.summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", type=Path, help="run directories or folders of them")
    parser.add_argument("--out", type=Path, help="where to write the table and plots (default: the first path)")
    parser.add_argument(
        "--reference",
        default="fedhm",
        help="the method every other one is compared with, seed by seed (default: fedhm)",
    )
    args = parser.parse_args(argv)
    out = args.out or args.paths[0]
    try:
        rows = write_summary(args.paths, out, args.reference)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(console_report(rows, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
