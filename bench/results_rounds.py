"""The gap by round on ``docs/RESULTS.md`` (#50): FedHM − each baseline, per model (the global one and
each level) and evaluation round, from the runs' ``metrics.jsonl`` (test-batch statistics: the only
ones measured before the last round), paired seed by seed and averaged over the seeds both ran. A plot
per claim family (:data:`bench.results_verdicts.FAMILIES`) and a table of the global model's and the
smallest level's gap, so that a verdict that holds at one round only shows as one."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from bench.results_verdicts import FAMILIES
from bench.studies import LABELS
from fedhm_flwr.reporting.pareto import levels_of
from fedhm_flwr.reporting.summary_stats import read_metrics


def accuracy_by_round(rows: list[dict[str, Any]], method: str) -> dict[Any, dict[str, dict[int, float]]]:
    """Seed -> model (``global``, ``level_0.125``, ...) -> round -> ``method``'s test-batch accuracy."""
    out: dict[Any, dict[str, dict[int, float]]] = {}
    for row in rows:
        if row["method"] != method:
            continue
        models: dict[str, dict[int, float]] = {}
        for line in read_metrics(Path(row["dir"])):
            for key, value in line.items():
                if key.startswith("acc/") and value is not None:
                    models.setdefault(key[4:], {})[int(line["round"])] = float(value)
        out[row["seed"]] = models
    return out


def gap_by_round(rows: list[dict[str, Any]], baseline: str, model: str) -> dict[int, tuple[float, int]]:
    """Round -> (mean over the paired seeds of FedHM − ``baseline`` on ``model``, in points; how many seeds)."""
    ours, theirs = accuracy_by_round(rows, "fedhm"), accuracy_by_round(rows, baseline)
    gaps: dict[int, list[float]] = {}
    for seed in set(ours) & set(theirs):
        a, b = ours[seed].get(model, {}), theirs[seed].get(model, {})
        for rnd in set(a) & set(b):
            gaps.setdefault(rnd, []).append((a[rnd] - b[rnd]) * 100)
    return {rnd: (math.fsum(v) / len(v), len(v)) for rnd, v in sorted(gaps.items())}


def models_of(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    """The models FedHM and ``baseline`` both evaluate: ``global`` and their common levels, largest first."""
    common = [g for g in levels_of(rows, "fedhm") if g in levels_of(rows, baseline)]
    return ["global", *(f"level_{g}" for g in common if g != "1")]


def write_gap_plots(rows: list[dict[str, Any]], title: str, out: Path) -> list[str]:
    """``gap_<family>.png`` under ``out``: per variant of the family, a panel of FedHM − it by round, one line
    per model; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedhm_flwr.reporting.summary_plots import save_figure

    names = []
    for family, members in FAMILIES.items():
        present = [v for v in members if any(r["method"] == v for r in rows)]
        if not present or not any(r["method"] == "fedhm" for r in rows):
            continue
        fig, axes = plt.subplots(1, len(present), figsize=(6 * len(present), 4), squeeze=False)
        for ax, variant in zip(axes[0], present):
            for model in models_of(rows, variant):
                series = gap_by_round(rows, variant, model)
                if series:
                    ax.plot(list(series), [m for m, _ in series.values()], "o-", ms=3, label=model.replace("_", " "))
            ax.axhline(0, color="grey", lw=0.8, ls="--")
            ax.set_xlabel("round")
            ax.set_ylabel("FedHM − baseline, test-batch accuracy (pt)\nmean over paired seeds")
            ax.set_title(f"{title}: FedHM − {LABELS[variant]}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        save_figure(fig, out / f"gap_{family.lower()}.png")
        names.append(f"gap_{family.lower()}.png")
    return names


def gap_section(rows: list[dict[str, Any]], title: str, out: Path, page: Path) -> list[str]:
    """The setting's gap-by-round plots and the table of the global model's and smallest level's gaps."""
    names = write_gap_plots(rows, title, out)
    if not names:
        return []
    variants = [v for members in FAMILIES.values() for v in members if any(r["method"] == v for r in rows)]
    rounds = sorted({rnd for v in variants for rnd in gap_by_round(rows, v, "global")})
    lines = [
        "#### The gap by round",
        "",
        "FedHM − each baseline by evaluation round (test-batch accuracy, paired seed by seed, mean over the "
        "seeds both ran; `bench/results_rounds.py`): a verdict judged at the last round alone would miss a gap that "
        "opens or closes in the last rounds. The global model and the smallest common level here, every level on "
        "the plots (one per baseline family).",
        "",
        "| FedHM − | model | " + " | ".join(f"r{r}" for r in rounds) + " |",
        "|---|---|" + "---|" * len(rounds),
    ]
    for variant in variants:
        models = models_of(rows, variant)
        for model in models[:1] + models[1:][-1:]:
            series = gap_by_round(rows, variant, model)
            cells = [f"{series[r][0]:+.1f}" if r in series else "" for r in rounds]
            lines.append(f"| {LABELS[variant]} | {model.replace('_', ' ')} | " + " | ".join(cells) + " |")
    rel = os.path.relpath(out, page.parent)
    return [*lines, "", " ".join(f"![FedHM − {n[4:-4]} by round]({rel}/{n})" for n in names), ""]
