"""Statistics over seeds of collected runs (:func:`fedhm_flwr.reporting.summary.collect` rows): grouping by
configuration, mean ± std and 95 % Student-t intervals per model, paired differences against a
reference method on the same seed, the last-10 % accuracies, and the Markdown of ``statistics.md``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedhm_flwr.math.stats import Estimate, mean_ci
from fedhm_flwr.reporting.results import METRICS_JSONL

#: swept keys that are options of a method (ablations): named in the method's label, not a setting
METHOD_OPTIONS = ("method.", "train.distill.")
#: the share of the last rounds averaged in the ``tail_acc/*`` columns
TAIL_FRACTION = 0.1
#: a level's costs a row keeps (``<cost>/level_<g>``): its own, and FedHM's figure of the resource its width was
#: matched on (levels.match=fedhm_params | fedhm_macs | fedhm_memory)
COSTS = ("params", "fedhm_params", "macs", "fedhm_macs", "memory", "fedhm_memory")


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
    levels = sorted(
        {k.split("/", 1)[1] for r in rows for k in r if k.startswith("final_acc/level_")},
        key=lambda m: -float(m.rsplit("_", 1)[1]),
    )
    return ["global", *levels]


def _estimate_fields(prefix: str, est: Estimate | None) -> dict[str, Any]:
    if est is None:
        return {}
    return {
        f"{prefix}_mean": est.mean,
        f"{prefix}_std": est.std,
        f"{prefix}_ci_low": est.low,
        f"{prefix}_ci_high": est.high,
    }


def column_values(rows: list[dict[str, Any]], column: str) -> list[float]:
    return [float(r[column]) for r in rows if r.get(column) is not None]


def seed_statistics(swept: list[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (without the seed) and per model (global, each level): n, mean, std and
    95 % t confidence interval of the final accuracy and of the last-10 % mean accuracy, with the
    model's parameters (FedHM's at that level for budget-matched runs) and MACs."""
    keys = group_keys(swept)
    out = []
    for members in group_runs(rows, keys).values():
        for model in models_of(members):
            final, tail = column_values(members, f"final_acc/{model}"), column_values(members, f"tail_acc/{model}")
            if not final:
                continue
            stat: dict[str, Any] = {k: members[0].get(k) for k in keys}
            stat["model"] = model
            stat["n"] = len(final)
            stat["seeds"] = ",".join(str(r.get("seed")) for r in members if r.get(f"final_acc/{model}") is not None)
            stat.update(_estimate_fields("final", mean_ci(final)))
            stat.update(_estimate_fields("tail", mean_ci(tail) if tail else None))
            for cost in COSTS:
                if model != "global" and members[0].get(f"{cost}/{model}") is not None:
                    stat[cost] = members[0][f"{cost}/{model}"]
            bytes_moved = column_values(members, "bytes_total")
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
        for runs in group_runs([r for r in members if r.get("method") != reference], ["method"]).values():
            for model in models_of(runs):
                for metric in ("final", "tail"):
                    column = f"{metric}_acc/{model}"
                    pairs = [
                        (r.get("seed"), float(r[column]) - float(ref[r.get("seed")][column]))
                        for r in runs
                        if r.get("seed") in ref
                        and r.get(column) is not None
                        and ref[r.get("seed")].get(column) is not None
                    ]
                    if not pairs:
                        continue
                    diff: dict[str, Any] = {k: members[0].get(k) for k in setting}
                    diff.update(
                        {
                            "method": runs[0].get("method"),
                            "reference": reference,
                            "model": model,
                            "metric": metric,
                            "n": len(pairs),
                            "per_seed": " ".join(f"{seed}:{d:+.4f}" for seed, d in pairs),
                        }
                    )
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
        keys = [
            k
            for k in stats[0]
            if k not in ("model", "n", "seeds") and not k.startswith(("final_", "tail_", *COSTS, "bytes_total"))
        ]
        matched = [c for c in COSTS if c.startswith("fedhm_") and (c == "fedhm_params" or any(c in s for s in stats))]
        view = [
            {
                **{k: s.get(k) for k in keys},
                "model": s["model"],
                "n": s["n"],
                "seeds": s["seeds"],
                "final": _pm(s.get("final_mean"), s.get("final_std")),
                "final 95% CI": _ci(s.get("final_ci_low"), s.get("final_ci_high")),
                "last 10%": _pm(s.get("tail_mean"), s.get("tail_std")),
                "last 10% 95% CI": _ci(s.get("tail_ci_low"), s.get("tail_ci_high")),
                "params": s.get("params"),
                **{f"FedHM {c.removeprefix('fedhm_')}": s.get(c) for c in matched},
            }
            for s in stats
        ]
        lines.append(_plain_table(view))
    lines += ["", f"## Paired differences against {reference} (same seed; method − {reference})", ""]
    if paired:
        view = [
            {
                **{k: p[k] for k in p if k not in ("mean", "std", "ci_low", "ci_high", "reference")},
                "mean ± std": _pm(p["mean"], p["std"]),
                "95% CI": _ci(p["ci_low"], p["ci_high"]),
            }
            for p in paired
        ]
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


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
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


def last_evaluations(metrics: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """``lastk_acc/<model>``: the mean accuracy of each model over its last ``k`` evaluations (the
    rounds whose row holds ``acc/<model>``; fewer when the run has fewer), and ``lastk_rounds``: the
    rounds of the global model's last ``k`` evaluations. Empty without metrics."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out: dict[str, Any] = {}
    for key in sorted({key for r in metrics for key in r if key.startswith("acc/")}):
        series = [(int(r["round"]), float(r[key])) for r in metrics if r.get(key) is not None][-k:]
        if series:
            out[f"lastk_acc/{key.split('/', 1)[1]}"] = math.fsum(v for _, v in series) / len(series)
            if key == "acc/global":
                out["lastk_rounds"] = [rnd for rnd, _ in series]
    return out
