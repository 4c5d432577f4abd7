"""``docs/RESULTS.md``'s answer to the question the FedHM papers ask (#50): for a device bound by the
bytes it receives (parameters), by compute (MACs) or by training memory, which method's model is best
at that budget, and what FedHM's levels actually save on each resource.

The budgets are FedHM's levels' own costs. At each, every model of every method whose cost on that
resource is at most the budget (:data:`TOLERANCE` above it allowed: matched widths are whole channels)
is a candidate; the best is the one with the highest mean final (deployable) accuracy over seeds, set
against FedHM's level seed by seed. These intervals are uncorrected: the claims are judged in the
verdict tables (:mod:`bench.results_verdicts`)."""

from __future__ import annotations

from typing import Any

from bench.studies import LABELS, VARIANTS
from fedhm_flwr.math.stats import mean_ci
from fedhm_flwr.reporting.pareto import RESOURCES, level_costs, levels_of

#: how far above the budget a candidate's cost may lie (matched widths are whole channels)
TOLERANCE = 0.02
#: what a device bound by a resource lacks, by resource
BOUND = {"params": "bytes on the wire (parameters)", "macs": "compute (MACs)", "memory": "training memory"}


def _accuracies(rows: list[dict[str, Any]], method: str, level: str) -> dict[Any, float]:
    key = f"final_acc/level_{level}"
    return {r["seed"]: float(r[key]) for r in rows if r["method"] == method and r.get(key) is not None}


def candidates(rows: list[dict[str, Any]], resource: str, budget: float) -> list[tuple[str, str, float]]:
    """(method, level, cost) of every model whose cost on ``resource`` is at most ``budget`` (+ tolerance)."""
    out = []
    for method in (v for v in VARIANTS if any(r["method"] == v for r in rows)):
        for level, cost in level_costs(rows, method, resource).items():
            if cost <= budget * (1 + TOLERANCE) and _accuracies(rows, method, level):
                out.append((method, level, cost))
    return out


def _pct(values: list[float]) -> str:
    est = mean_ci(values)
    return f"{est.mean * 100:.2f}" + ("" if est.n < 2 else f" [{est.low * 100:.2f}, {est.high * 100:.2f}]")


def choice_rows(rows: list[dict[str, Any]], levels: list[str] | None = None) -> list[str]:
    """The table's lines: per resource and FedHM level (its cost as the budget), the best model within it."""
    out = []
    for resource in RESOURCES:
        fedhm = level_costs(rows, "fedhm", resource)
        for level in levels or levels_of(rows, "fedhm"):
            if level not in fedhm:
                continue
            budget = fedhm[level]
            found = candidates(rows, resource, budget)
            best = max(found, key=lambda c: mean_ci(list(_accuracies(rows, c[0], c[1]).values())).mean)
            ours, theirs = _accuracies(rows, "fedhm", level), _accuracies(rows, best[0], best[1])
            paired = [theirs[k] - ours[k] for k in sorted(set(ours) & set(theirs), key=str)]
            est = mean_ci(paired) if paired else None
            gap = (
                "it is FedHM's level"
                if best[:2] == ("fedhm", level)
                else ""
                if est is None
                else f"{est.mean * 100:+.2f}"
                + ("" if est.n < 2 else f" [{est.low * 100:+.2f}, {est.high * 100:+.2f}]")
                + f" ({est.n} seeds)"
            )
            out.append(
                f"| {BOUND[resource]} | γ = {level} | {len(found)} | {LABELS[best[0]]}, level {best[1]} "
                f"({best[2] / budget:.0%} of the budget) | {_pct(list(theirs.values()))} | "
                f"{_pct(list(ours.values()))} | {gap} |"
            )
    return out


def savings_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Per FedHM level: its cost on each resource as a share of FedHM's full model's, and the saving."""
    costs = {r: level_costs(rows, "fedhm", r) for r in RESOURCES}
    out = []
    for level in levels_of(rows, "fedhm"):
        cells = []
        for resource in RESOURCES:
            full, own = costs[resource].get("1"), costs[resource].get(level)
            cells.append("" if not full or own is None else f"{own / full:.0%} (saves {1 - own / full:.0%})")
        out.append(f"| γ = {level} | " + " | ".join(cells) + " |")
    return out


def choice_section(rows: list[dict[str, Any]], smallest_only: bool = False) -> list[str]:
    """The setting's "which method for which constraint" part (``smallest_only``: at FedHM's smallest level's
    budgets only, for the README)."""
    if not any(r["method"] == "fedhm" for r in rows):
        return []
    levels = levels_of(rows, "fedhm")
    return [
        "What FedHM's levels cost, as a share of its full model (γ = 1), on each resource a device may lack:",
        "",
        "| FedHM level | parameters (bytes on the wire) | MACs (compute) | training memory |",
        "|---|---|---|---|",
        *savings_rows(rows),
        "",
        "Which model is best for a device bound by one resource: the budget is a FedHM level's cost on it, the "
        f"candidates every method's models that cost at most that (+{TOLERANCE:.0%}: matched widths are whole "
        "channels), the best the highest mean final deployable accuracy over seeds (95 % interval in brackets; "
        "uncorrected: the verdict tables above judge the claims; `bench/results_choice.py`):",
        "",
        "| bound by | budget: FedHM's cost at | candidates | best model within it | its accuracy (%) | "
        "FedHM's level (%) | best − FedHM (pt) |",
        "|---|---|---|---|---|---|---|",
        *choice_rows(rows, levels[-1:] if smallest_only else levels),
    ]
