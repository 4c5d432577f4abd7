"""The plots of a summary: mean accuracy by round with 95 % CI bands, and accuracy against bytes
moved, parameters, MACs and estimated training memory with 95 % CI error bars over seeds."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from fedhm_flwr.math.stats import mean_ci
from fedhm_flwr.reporting.results import atomic_write
from fedhm_flwr.reporting.summary_stats import column_values, group_keys, group_runs, models_of, read_metrics


def _label(row: dict[str, Any], keys: list[str]) -> str:
    """A configuration's name in plot legends: the method and its other swept values."""
    parts = [f"{k.split('.')[-1]}={row.get(k)}" for k in keys if k != "method"]
    return " ".join([str(row.get("method")), *parts])


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def _half(values: list[float]) -> float:
    est = mean_ci(values)
    return 0.0 if math.isnan(est.half_width) else est.half_width


def write_plots(swept: list[str], rows: list[dict[str, Any]], out: Path, costs: bool = True) -> None:
    """Mean curves with 95 % CI bands, and accuracy against bytes, parameters, MACs and training
    memory with 95 % CI error bars over seeds (one colour per configuration); ``costs=False``: the
    last three left out (the results page draws its own: ``bench/results_pareto.py``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = group_keys(swept)
    groups = list(group_runs(rows, keys).values())

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for members in groups:
        by_round: dict[int, list[float]] = {}
        for row in members:
            for r in read_metrics(Path(row["dir"])):
                if r.get("acc/global") is not None:
                    by_round.setdefault(int(r["round"]), []).append(float(r["acc/global"]))
        rounds = sorted(by_round)
        if not rounds:
            continue
        est = [mean_ci(by_round[x]) for x in rounds]
        (line,) = ax.plot(
            rounds, [e.mean for e in est], marker="o", ms=3, label=f"{_label(members[0], keys)} (n={len(members)})"
        )
        if len(members) > 1:
            ax.fill_between(
                rounds,
                [max(0.0, e.low) if e.n > 1 else e.mean for e in est],  # accuracies: [0, 1]
                [min(1.0, e.high) if e.n > 1 else e.mean for e in est],
                color=line.get_color(),
                alpha=0.2,
            )
    ax.set_xlabel("round")
    # matplotlib types the locator as the base Locator (it is a MaxNLocator, which takes integer=)
    ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]
    ax.set_ylabel("global model test accuracy (mean, 95 % CI band)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, out / "accuracy_by_round.png")

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = "sv^<>dph"
    for members in groups:
        moved = column_values(members, "bytes_total")
        if not moved:
            continue
        x, xerr = math.fsum(moved) / len(moved) / 1e6, _half(moved) / 1e6
        colour = None
        for i, model in enumerate(models_of(members)):  # global filled, each level hollow
            acc = column_values(members, f"final_acc/{model}")
            if not acc:
                continue
            bar = ax.errorbar(
                x,
                math.fsum(acc) / len(acc),
                yerr=_half(acc),
                xerr=xerr,
                capsize=3,
                color=colour,
                fmt="o" if i == 0 else markers[(i - 1) % len(markers)],
                mfc=None if i == 0 else "none",
                label=_label(members[0], keys) if i == 0 else None,
            )
            colour = bar.lines[0].get_color()
    ax.set_xlabel("cumulative bytes moved, both directions (MB)")
    ax.set_ylabel("final accuracy (global: filled; levels, largest first: s v ^ < >)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    save_figure(fig, out / "accuracy_vs_bytes.png")

    if not costs:
        return
    for cost, name in (
        ("params", "parameters"),
        ("macs", "MACs per input"),
        ("memory", "estimated training memory, bytes"),
    ):
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for members in groups:
            points = []
            for model in models_of(members)[1:]:
                acc = column_values(members, f"final_acc/{model}")
                spent = members[0].get(f"{cost}/{model}")
                if acc and spent:
                    points.append((float(spent), math.fsum(acc) / len(acc), _half(acc)))
            if points:
                points.sort()
                ax.errorbar(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    yerr=[p[2] for p in points],
                    fmt="o-",
                    ms=4,
                    capsize=3,
                    label=_label(members[0], keys),
                )
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} of the level's model (log)")
        ax.set_ylabel("final accuracy of the level's model")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        save_figure(fig, out / f"accuracy_vs_{cost}.png")
