"""Collect finished runs into tables over seeds and plots.

``python -m fedhm_flwr.summary DIR [DIR ...] [--out OUT] [--reference METHOD]``: every DIR is a
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
  ``accuracy_vs_params.png`` and ``accuracy_vs_macs.png`` (final accuracy of each level's model
  against its parameters / MACs); error bars are the 95 % CIs over seeds.

:func:`write_summary` is the function a results page builds on: it tabulates whatever finished
run directories it is given.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fedhm_flwr.results import CONFIG_FILE, METRICS_JSONL, SUMMARY_FILE, atomic_write
from fedhm_flwr.stats import Estimate, mean_ci

IGNORED = ("output_dir", "dataset.data_dir", "timeout")
# summary keys shown as accuracy columns: the server's test set, then the clients' federated figures
ACC_PREFIXES = ("final_acc/", "best_acc/", "final_fed_acc/", "best_fed_acc/", "final_fed_acc_clients/")
#: swept keys that are options of a method (ablations): named in the method's label, not a setting
METHOD_OPTIONS = ("method.", "train.distill.")
#: the share of the last rounds averaged in the ``tail_acc/*`` columns
TAIL_FRACTION = 0.1


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
    for run_dir, value, config in zip(run_dirs, values, configs):
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        row: dict[str, Any] = {"run": run_dir.name}
        row.update({k: value.get(k) for k in swept})
        row.setdefault("method", summary.get("method"))  # a swept method group keeps its option name
        row.setdefault("seed", config.get("seed"))
        for key, value in summary.items():
            if key.startswith(ACC_PREFIXES):
                row[key] = value
        row.update(tail_accuracies(_read_metrics(run_dir)))
        for level, cost in summary.get("level_costs", {}).items():
            for name in ("params", "fedhm_params", "macs"):
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


# ------------------------------------------------------------------ statistics over seeds


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


def setting_keys(swept: list[str]) -> list[str]:
    """What the methods are compared on: the swept values other than seed, method and its options."""
    return [k for k in swept if k not in ("seed", "method") and not k.startswith(METHOD_OPTIONS)]


def group_keys(swept: list[str]) -> list[str]:
    """What identifies a configuration: the method and the swept values, without the seed."""
    return ["method"] + [k for k in swept if k not in ("seed", "method")]


def _key(row: dict[str, Any], keys: list[str]) -> tuple[str, ...]:
    return tuple(json.dumps(row.get(k), sort_keys=True, default=str) for k in keys)


def group_runs(rows: list[dict[str, Any]], keys: list[str]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Rows grouped by their values of ``keys`` (first-seen order)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_key(row, keys), []).append(row)
    return groups


def models_of(rows: list[dict[str, Any]]) -> list[str]:
    """``global`` then the levels present in the rows' final accuracies, largest first."""
    levels = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("final_acc/level_")},
                    key=lambda m: -float(m.rsplit("_", 1)[1]))
    return ["global", *levels]


def _estimate_fields(prefix: str, est: Estimate | None) -> dict[str, Any]:
    if est is None:
        return {}
    return {f"{prefix}_mean": est.mean, f"{prefix}_std": est.std, f"{prefix}_ci_low": est.low,
            f"{prefix}_ci_high": est.high}


def _values(rows: list[dict[str, Any]], column: str) -> list[float]:
    return [float(r[column]) for r in rows if r.get(column) is not None]


def seed_statistics(swept: list[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (without the seed) and per model (global, each level): n, mean, std and
    95 % t confidence interval of the final accuracy and of the last-10 % mean accuracy, with the
    model's parameters (FedHM's at that level for budget-matched runs) and MACs."""
    keys = group_keys(swept)
    out = []
    for members in group_runs(rows, keys).values():
        for model in models_of(members):
            final, tail = _values(members, f"final_acc/{model}"), _values(members, f"tail_acc/{model}")
            if not final:
                continue
            stat: dict[str, Any] = {k: members[0].get(k) for k in keys}
            stat["model"] = model
            stat["n"] = len(final)
            stat["seeds"] = ",".join(str(r.get("seed")) for r in members if r.get(f"final_acc/{model}") is not None)
            stat.update(_estimate_fields("final", mean_ci(final)))
            stat.update(_estimate_fields("tail", mean_ci(tail) if tail else None))
            for cost in ("params", "fedhm_params", "macs"):
                if model != "global" and members[0].get(f"{cost}/{model}") is not None:
                    stat[cost] = members[0][f"{cost}/{model}"]
            bytes_moved = _values(members, "bytes_total")
            if bytes_moved:
                stat["bytes_total_mean"] = math.fsum(bytes_moved) / len(bytes_moved)
            out.append(stat)
    return out


def paired_differences(swept: list[str], rows: list[dict[str, Any]], reference: str = "fedhm") -> list[dict[str, Any]]:
    """Per setting (the configuration without seed and method), every method minus ``reference``
    on the same seed: the per-seed differences of the final and last-10 % accuracy of each model,
    their mean, std and 95 % t confidence interval. Seeds only one side ran are left out."""
    setting = setting_keys(swept)
    out = []
    for members in group_runs(rows, setting).values():
        ref = {r.get("seed"): r for r in members if r.get("method") == reference}
        if not ref:
            continue
        for method, runs in group_runs([r for r in members if r.get("method") != reference], ["method"]).items():
            for model in models_of(runs):
                for metric in ("final", "tail"):
                    column = f"{metric}_acc/{model}"
                    pairs = [(r.get("seed"), float(r[column]) - float(ref[r.get("seed")][column]))
                             for r in runs if r.get("seed") in ref and r.get(column) is not None
                             and ref[r.get("seed")].get(column) is not None]
                    if not pairs:
                        continue
                    diff: dict[str, Any] = {k: members[0].get(k) for k in setting}
                    diff.update({"method": runs[0].get("method"), "reference": reference, "model": model,
                                 "metric": metric, "n": len(pairs),
                                 "per_seed": " ".join(f"{seed}:{d:+.4f}" for seed, d in pairs)})
                    est = mean_ci([d for _, d in pairs])
                    diff.update({"mean": est.mean, "std": est.std, "ci_low": est.low, "ci_high": est.high})
                    out.append(diff)
    return out


def _pm(mean: Any, std: Any) -> str:
    if mean is None:
        return ""
    return f"{mean:.4f}" if std is None or math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def _ci(low: Any, high: Any) -> str:
    return "" if low is None or math.isnan(low) else f"[{low:.4f}, {high:.4f}]"


def statistics_markdown(stats: list[dict[str, Any]], paired: list[dict[str, Any]], reference: str) -> str:
    """The two tables of ``statistics.md``, rendered for reading (the CSVs keep the numbers)."""
    lines = ["## Accuracy over seeds (mean ± std, 95 % Student-t CI)", ""]
    if stats:
        keys = [k for k in stats[0] if k not in ("model", "n", "seeds") and not k.startswith(
            ("final_", "tail_", "params", "fedhm_params", "macs", "bytes_total"))]
        view = [{**{k: s.get(k) for k in keys}, "model": s["model"], "n": s["n"], "seeds": s["seeds"],
                 "final": _pm(s.get("final_mean"), s.get("final_std")),
                 "final 95% CI": _ci(s.get("final_ci_low"), s.get("final_ci_high")),
                 "last 10%": _pm(s.get("tail_mean"), s.get("tail_std")),
                 "last 10% 95% CI": _ci(s.get("tail_ci_low"), s.get("tail_ci_high")),
                 "params": s.get("params"), "FedHM params": s.get("fedhm_params")} for s in stats]
        lines.append(_plain_table(view))
    lines += ["", f"## Paired differences against {reference} (same seed; method − {reference})", ""]
    if paired:
        view = [{**{k: p[k] for k in p if k not in ("mean", "std", "ci_low", "ci_high", "reference")},
                 "mean ± std": _pm(p["mean"], p["std"]), "95% CI": _ci(p["ci_low"], p["ci_high"])}
                for p in paired]
        lines.append(_plain_table(view))
    else:
        lines.append(f"(no run of the reference method {reference!r} shares a setting and seed with another method)")
    return "\n".join(lines) + "\n"


def _plain_table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and any(x.get(k) is not None for x in rows)]

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _csv(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    cols = columns or list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_JSONL
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def tail_accuracies(metrics: list[dict[str, Any]], fraction: float = TAIL_FRACTION) -> dict[str, float]:
    """``tail_acc/<model>``: the mean accuracy over the evaluations of the last ``ceil(fraction ·
    rounds)`` rounds (at least one round; the last evaluation when none fell in that window)."""
    if not metrics:
        return {}
    last = max(int(r["round"]) for r in metrics)
    window = max(1, math.ceil(fraction * last - 1e-9))
    out: dict[str, float] = {}
    for key in sorted({k for r in metrics for k in r if k.startswith("acc/")}):
        series = [(int(r["round"]), float(r[key])) for r in metrics if r.get(key) is not None]
        if not series:
            continue
        tail = [v for rnd, v in series if rnd > last - window] or [series[-1][1]]
        out[f"tail_acc/{key.split('/', 1)[1]}"] = math.fsum(tail) / len(tail)
    return out


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
    accs = sorted((c for c in cols if c.startswith(kinds)),
                  key=lambda c: ("fed_" in c, level_of(c), [c.startswith(k) for k in kinds].index(True)))
    costs = ("params/", "fedhm_params/", "macs/")
    params = sorted((c for c in cols if c.startswith(costs)),
                    key=lambda c: ([c.startswith(k) for k in costs].index(True), level_of(c)))
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


def _label(row: dict[str, Any], keys: list[str]) -> str:
    """A configuration's name in plot legends: the method and its other swept values."""
    parts = [f"{k.split('.')[-1]}={row.get(k)}" for k in keys if k != "method"]
    return " ".join([str(row.get("method")), *parts])


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def _half(values: list[float]) -> float:
    est = mean_ci(values)
    return 0.0 if math.isnan(est.half_width) else est.half_width


def write_plots(swept: list[str], rows: list[dict[str, Any]], out: Path) -> None:
    """Mean curves with 95 % CI bands, and accuracy against bytes, parameters and MACs with 95 % CI
    error bars over seeds (one colour per configuration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = group_keys(swept)
    groups = list(group_runs(rows, keys).values())

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for members in groups:
        by_round: dict[int, list[float]] = {}
        for row in members:
            for r in _read_metrics(Path(row["dir"])):
                if r.get("acc/global") is not None:
                    by_round.setdefault(int(r["round"]), []).append(float(r["acc/global"]))
        rounds = sorted(by_round)
        if not rounds:
            continue
        est = [mean_ci(by_round[x]) for x in rounds]
        line, = ax.plot(rounds, [e.mean for e in est], marker="o", ms=3,
                        label=f"{_label(members[0], keys)} (n={len(members)})")
        if len(members) > 1:
            ax.fill_between(rounds, [max(0.0, e.low) if e.n > 1 else e.mean for e in est],  # accuracies: [0, 1]
                            [min(1.0, e.high) if e.n > 1 else e.mean for e in est], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("global model test accuracy (mean, 95 % CI band)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out / "accuracy_by_round.png")

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = "sv^<>dph"
    for members in groups:
        moved = _values(members, "bytes_total")
        if not moved:
            continue
        x, xerr = math.fsum(moved) / len(moved) / 1e6, _half(moved) / 1e6
        colour = None
        for i, model in enumerate(models_of(members)):  # global filled, each level hollow
            acc = _values(members, f"final_acc/{model}")
            if not acc:
                continue
            bar = ax.errorbar(x, math.fsum(acc) / len(acc), yerr=_half(acc), xerr=xerr, capsize=3, color=colour,
                              fmt="o" if i == 0 else markers[(i - 1) % len(markers)],
                              mfc=None if i == 0 else "none",
                              label=_label(members[0], keys) if i == 0 else None)
            colour = bar.lines[0].get_color()
    ax.set_xlabel("cumulative bytes moved, both directions (MB)")
    ax.set_ylabel("final accuracy (global: filled; levels, largest first: s v ^ < >)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    _save(fig, out / "accuracy_vs_bytes.png")

    for cost, name in (("params", "parameters"), ("macs", "MACs per input")):
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for members in groups:
            points = []
            for model in models_of(members)[1:]:
                acc = _values(members, f"final_acc/{model}")
                x = members[0].get(f"{cost}/{model}")
                if acc and x:
                    points.append((float(x), math.fsum(acc) / len(acc), _half(acc)))
            if points:
                points.sort()
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                            fmt="o-", ms=4, capsize=3, label=_label(members[0], keys))
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} of the level's model (log)")
        ax.set_ylabel("final accuracy of the level's model")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        _save(fig, out / f"accuracy_vs_{cost}.png")


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
    parser = argparse.ArgumentParser(prog="python -m fedhm_flwr.summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="run directories or folders of them")
    parser.add_argument("--out", type=Path, help="where to write the table and plots (default: the first path)")
    parser.add_argument("--reference", default="fedhm",
                        help="the method every other one is compared with, seed by seed (default: fedhm)")
    args = parser.parse_args(argv)
    out = args.out or args.paths[0]
    try:
        rows = write_summary(args.paths, out, args.reference)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(rows))
    print((out / "statistics.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
