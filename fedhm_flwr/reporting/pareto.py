"""Accuracy per level against one resource, and a verdict per resource. No Flower.

HeteroFL's and FedRolex's widths are matched to FedHM's levels on one resource (``levels.match``:
parameters, MACs or training memory; docs/METHODS.md#heterofl); on the two others the "matched"
models differ. On a resource some runs of a baseline were matched on, FedHM's level ``γ`` is set
against those runs' level ``γ`` directly (:func:`same_level_verdicts`, :func:`resource_comparison`).
On a resource no run was matched on, FedHM's level ``γ`` of cost ``c`` on resource ``r`` is set
against the baseline's accuracy **at equal cost**, labelled *interpolated*: the baseline's per-level
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

from fedhm_flwr.math.stats import Estimate, mean_ci, resolution_p
from fedhm_flwr.reporting.verdicts import CONTRADICTED, SUPPORTED, verdict

#: the resources a level costs (``<resource>/level_<g>`` in a row) -> their name on the page
RESOURCES = {"params": "parameters", "macs": "MACs", "memory": "training memory"}
#: ``levels.match`` -> the resource a baseline's widths were matched to FedHM's on
MATCH_RESOURCE = {"fedhm_params": "params", "fedhm_macs": "macs", "fedhm_memory": "memory"}
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


def per_seed(rows: Iterable[Mapping[str, Any]], method: str, prefix: str = "final_acc/") -> dict[Any, dict[str, float]]:
    """Seed -> level -> ``method``'s accuracy ``<prefix>level_<g>`` of that level (``final_acc/``: the final
    evaluation; ``lastk_acc/``: the mean of the last evaluations)."""
    out: dict[Any, dict[str, float]] = {}
    for r in rows:
        if r["method"] == method:
            out[r["seed"]] = {
                k.rsplit("_", 1)[1]: float(v) for k, v in r.items() if k.startswith(f"{prefix}level_") and v is not None
            }
    return out


def _judged(entry: dict[str, Any], diffs: list[tuple[Any, float]]) -> dict[str, Any]:
    """``entry`` with the paired ``per_seed`` differences, their ``estimate``, ``n``, ``p``
    (:func:`~fedhm_flwr.math.stats.resolution_p`) and the ``verdict`` (above / below / not resolved)."""
    est: Estimate | None = mean_ci([d for _, d in diffs]) if diffs else None
    word = {SUPPORTED: ABOVE, CONTRADICTED: BELOW}.get(verdict(est), verdict(est))
    p = math.nan if est is None else resolution_p(est)
    return {**entry, "n": len(diffs), "per_seed": diffs, "estimate": est, "verdict": word, "p": p}


def matched_on(rows: Iterable[Mapping[str, Any]], method: str) -> str | None:
    """The resource ``method``'s widths were matched to FedHM's on (every run's ``levels.match`` one of
    :data:`MATCH_RESOURCE`'s), else None."""
    values = {str(r.get("levels.match")) for r in rows if r["method"] == method}
    return MATCH_RESOURCE.get(values.pop()) if len(values) == 1 else None


def same_level_verdicts(
    rows: list[Mapping[str, Any]], reference: str, resource: str, method: str = "fedhm", prefix: str = "final_acc/"
) -> list[dict[str, Any]]:
    """Per level of ``method`` that ``reference`` also has (largest first): ``method − reference`` at that
    level, seed by seed, as in :func:`resource_verdicts` but with no interpolation (``how``: ``matched``):
    for a reference whose widths were matched to ``method``'s on ``resource``, its level costs what
    ``method``'s does (``cost`` and ``ref_cost``: both recorded costs)."""
    own, ref = level_costs(rows, method, resource), level_costs(rows, reference, resource)
    ours, theirs = per_seed(rows, method, prefix), per_seed(rows, reference, prefix)
    out = []
    for level, cost in own.items():
        if level not in ref:
            continue
        seeds = sorted(set(ours) & set(theirs), key=str)
        diffs = [(k, ours[k][level] - theirs[k][level]) for k in seeds if level in ours[k] and level in theirs[k]]
        entry = {"level": level, "cost": cost, "ref_cost": ref[level], "how": "matched", "reference": reference}
        out.append(_judged(entry, diffs))
    return out


def resource_comparison(
    rows: list[Mapping[str, Any]], family: Sequence[str], resource: str, prefix: str = "final_acc/"
) -> list[dict[str, Any]]:
    """FedHM's levels against one baseline family (its variants, e.g. HeteroFL matched on parameters and on
    training memory) on ``resource``: against the variant whose widths were matched on ``resource``, level
    by level (:func:`same_level_verdicts`); where the family has none, the first variant with runs
    interpolated at FedHM's cost (:func:`resource_verdicts`, ``how``: ``interpolated``)."""
    present = [v for v in family if any(r["method"] == v for r in rows)]
    matched = [v for v in present if matched_on(rows, v) == resource]
    if matched:
        return same_level_verdicts(rows, matched[0], resource, prefix=prefix)
    return resource_verdicts(rows, present[0], resource, prefix=prefix) if present else []


def resource_verdicts(
    rows: list[Mapping[str, Any]], reference: str, resource: str, method: str = "fedhm", prefix: str = "final_acc/"
) -> list[dict[str, Any]]:
    """Per level of ``method`` (largest first): ``level``, its ``cost`` on ``resource``, the
    reference's measured ``range`` (min, max), the paired ``per_seed`` differences
    (``method − reference`` at equal cost), their ``estimate`` (or None) and the ``verdict``
    (see the module docstring). Empty when either method has no run or no recorded cost."""
    own, ref = level_costs(rows, method, resource), level_costs(rows, reference, resource)
    if not own or not ref:
        return []
    ours, theirs = per_seed(rows, method, prefix), per_seed(rows, reference, prefix)
    out = []
    for level, cost in own.items():
        entry: dict[str, Any] = {
            "level": level,
            "cost": cost,
            "range": (min(ref.values()), max(ref.values())),
            "how": "interpolated",
            "reference": reference,
        }
        diffs: list[tuple[Any, float]] = []
        for seed in sorted(set(ours) & set(theirs), key=str):
            accs = theirs[seed]
            measured = [g for g in ref if g in accs]
            if level not in ours[seed] or len(measured) < len(ref):
                continue  # a seed whose runs lack a level's accuracy is not paired
            at = interpolate([ref[g] for g in measured], [accs[g] for g in measured], cost)
            if at is not None:
                diffs.append((seed, ours[seed][level] - at))
        judged = _judged(entry, diffs)
        if not entry["range"][0] <= cost <= entry["range"][1]:
            judged.update(verdict=NOT_COMPARABLE, p=math.nan)
        out.append(judged)
    return out
