"""Accuracy per level against one resource, and a verdict per resource. No Flower.

HeteroFL's and FedRolex's widths are matched to FedHM's levels on one resource (``levels.match``:
parameters, MACs or training memory; docs/METHODS.md#heterofl); on the two others the "matched"
models differ. To compare on any resource without new runs, FedHM's level ``γ`` of cost ``c`` on
resource ``r`` is set against the baseline's accuracy **at equal cost**: the baseline's per-level
accuracies interpolated linearly in ``log r`` (:func:`interpolate`), only inside the baseline's
measured range ``[min, max]`` of its levels' costs: outside it the baseline was not measured at that
cost and the level is **not comparable**.

The rule is the page's paired one (:mod:`fedhm_flwr.reporting.verdicts`): for every seed ``k`` both
methods ran (same partitions, sampling and initial model), ``d_k = a_k(γ) − b_k(c)`` with ``b_k(c)``
interpolated from seed ``k``'s own per-level accuracies of the baseline; the 95 % Student-t interval
of the mean of the ``d_k`` decides: **above** when it lies above 0, **below** when it lies below 0,
otherwise **not resolved at n seeds**. Every run of one method and level must record the same cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fedhm_flwr.math.stats import Estimate, mean_ci
from fedhm_flwr.reporting.verdicts import CONTRADICTED, SUPPORTED, verdict

#: the resources a level costs (``<resource>/level_<g>`` in a row) -> their name on the page
RESOURCES = {"params": "parameters", "macs": "MACs", "memory": "training memory"}
ABOVE, BELOW, NOT_COMPARABLE = "above", "below", "not comparable"


def interpolate(costs: Sequence[float], values: Sequence[float], at: float) -> float | None:
    """The value at cost ``at``, linear in ``log(cost)`` between the two nearest ``costs`` (their
    ``values``); ``None`` when ``at`` lies outside ``[min(costs), max(costs)]``. Costs must be
    positive and distinct."""
    if len(costs) != len(values) or not costs:
        raise ValueError(f"costs and values must be non-empty and of one length, got {len(costs)} and {len(values)}")
    if min(costs) <= 0 or at <= 0:
        raise ValueError(f"costs must be positive, got {list(costs)} and at={at}")
    pairs = sorted(zip((math.log(c) for c in costs), values))
    xs = [x for x, _ in pairs]
    if len(set(xs)) < len(xs):
        raise ValueError(f"costs must be distinct, got {sorted(costs)}")
    x = math.log(at)
    if x < xs[0] or x > xs[-1]:
        return None
    return float(np.interp(x, xs, [float(v) for _, v in pairs]))


def levels_of(rows: Iterable[Mapping[str, Any]], method: str) -> list[str]:
    """The levels (``"0.125"``) of ``method``'s final accuracies in ``rows``, largest first."""
    found = {k.rsplit("_", 1)[1] for r in rows if r["method"] == method for k in r if k.startswith("final_acc/level_")}
    return sorted(found, key=lambda g: -float(g))


def level_costs(rows: Iterable[Mapping[str, Any]], method: str, resource: str) -> dict[str, float]:
    """Level -> ``method``'s cost on ``resource`` (``<resource>/level_<g>``), the same in every run."""
    if resource not in RESOURCES:
        raise ValueError(f"resource={resource!r}; allowed: {', '.join(RESOURCES)}")
    rows = [r for r in rows if r["method"] == method]
    out: dict[str, float] = {}
    for level in levels_of(rows, method):
        seen = {float(r[f"{resource}/level_{level}"]) for r in rows if r.get(f"{resource}/level_{level}") is not None}
        if len(seen) > 1:
            raise ValueError(f"{method} level {level}: its runs record different {resource}: {sorted(seen)}")
        if seen:
            out[level] = seen.pop()
    return out


def per_seed(rows: Iterable[Mapping[str, Any]], method: str) -> dict[Any, dict[str, float]]:
    """Seed -> level -> ``method``'s final accuracy of that level."""
    out: dict[Any, dict[str, float]] = {}
    for r in rows:
        if r["method"] == method:
            out[r["seed"]] = {
                k.rsplit("_", 1)[1]: float(v)
                for k, v in r.items()
                if k.startswith("final_acc/level_") and v is not None
            }
    return out


def resource_verdicts(
    rows: list[Mapping[str, Any]], reference: str, resource: str, method: str = "fedhm"
) -> list[dict[str, Any]]:
    """Per level of ``method`` (largest first): ``level``, its ``cost`` on ``resource``, the
    reference's measured ``range`` (min, max), the paired ``per_seed`` differences
    (``method − reference`` at equal cost), their ``estimate`` (or None) and the ``verdict``
    (see the module docstring). Empty when either method has no run or no recorded cost."""
    own, ref = level_costs(rows, method, resource), level_costs(rows, reference, resource)
    if not own or not ref:
        return []
    ours, theirs = per_seed(rows, method), per_seed(rows, reference)
    out = []
    for level, cost in own.items():
        entry: dict[str, Any] = {"level": level, "cost": cost, "range": (min(ref.values()), max(ref.values()))}
        diffs: list[tuple[Any, float]] = []
        for seed in sorted(set(ours) & set(theirs), key=str):
            accs = theirs[seed]
            measured = [g for g in ref if g in accs]
            if level not in ours[seed] or len(measured) < len(ref):
                continue  # a seed whose runs lack a level's accuracy is not paired
            at = interpolate([ref[g] for g in measured], [accs[g] for g in measured], cost)
            if at is not None:
                diffs.append((seed, ours[seed][level] - at))
        est: Estimate | None = mean_ci([d for _, d in diffs]) if diffs else None
        if not entry["range"][0] <= cost <= entry["range"][1]:
            word = NOT_COMPARABLE
        else:
            word = {SUPPORTED: ABOVE, CONTRADICTED: BELOW}.get(verdict(est), verdict(est))
        out.append({**entry, "n": len(diffs), "per_seed": diffs, "estimate": est, "verdict": word})
    return out
