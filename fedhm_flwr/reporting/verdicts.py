"""Verdicts on the papers' claims from paired differences over seeds. No Flower.

A claim compares two accuracies run by run on the same seed (same partitions, sampling and initial
model): ``d_k = a_k − b_k`` for every seed ``k`` both runs finished. Its verdict comes from the 95 %
Student-t confidence interval ``[low, high]`` of the mean of the ``d_k`` (:func:`fedhm_flwr.math.stats.mean_ci`):

* a claim that ``a`` beats ``b`` (``kind="greater"``) is **supported** when ``low > 0``,
  **contradicted** when ``high < 0`` (``b`` beats ``a``), else **not resolved at n seeds**;
* a claim that ``a`` is within ``margin`` of ``b`` (``kind="within"``) is **supported** when the
  whole interval lies inside ``(−margin, +margin)``, **contradicted** when it lies wholly outside
  (``low > margin`` or ``high < −margin``), else **not resolved at n seeds**;
* with fewer than two paired seeds there is no interval: **not resolved at n seeds**.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedhm_flwr.math.stats import Estimate, mean_ci, resolution_p

SUPPORTED, CONTRADICTED = "supported", "contradicted"
RULE = (
    "each claim is judged on the 95 % Student-t interval of its paired per-seed difference: a claim "
    "that A beats B is *supported* when the interval lies above 0, *contradicted* when it lies below 0, "
    "otherwise *not resolved at n seeds*; a claim that A is within 1 pt of B is *supported* when the "
    "interval lies inside (−1, +1) pt, *contradicted* when it lies wholly outside, otherwise *not "
    "resolved at n seeds*; fewer than 2 paired seeds: *not resolved*"
)


def not_resolved(n: int) -> str:
    return f"not resolved at {n} seed{'s' if n != 1 else ''}"


def verdict(est: Estimate | None, kind: str = "greater", margin: float = 0.0) -> str:
    """The verdict of a paired difference (see the module docstring)."""
    if kind not in ("greater", "within"):
        raise ValueError(f"kind must be 'greater' or 'within', got {kind!r}")
    if est is None or est.n < 2:
        return not_resolved(0 if est is None else est.n)
    if kind == "greater":
        return SUPPORTED if est.low > 0 else CONTRADICTED if est.high < 0 else not_resolved(est.n)
    if -margin < est.low and est.high < margin:
        return SUPPORTED
    return CONTRADICTED if est.low > margin or est.high < -margin else not_resolved(est.n)


@dataclass(frozen=True)
class Claim:
    """``method``'s ``column`` against ``reference``'s ``ref_column`` (``{smallest}`` in a column
    is replaced by the smallest level present; ``{matched}`` in the text by what the reference's
    widths were matched on: :func:`matched_label`)."""

    text: str
    method: str
    column: str
    reference: str
    ref_column: str
    kind: str = "greater"
    margin: float = 0.0


#: the baselines FedHM is set against, level by level: the results' method name -> the name a claim gives it
#: (a baseline's widths, matched on one resource, are named by :func:`matched_label` from its runs)
BASELINES = {
    "heterofl": "HeteroFL",
    "heterofl_memory": "HeteroFL",
    "fedrolex": "FedRolex",
    "fedrolex_memory": "FedRolex",
    "fjord": "FjORD",
}

#: the claims the results page judges (accuracies are fractions: 0.01 = 1 pt)
CLAIMS = (
    Claim(
        "FedHM's global model beats FedAvg trained on the smallest FedHM model",
        "fedhm",
        "final_acc/global",
        "fedavg_smallest",
        "final_acc/global",
    ),
    *(
        Claim(
            f"FedHM beats {name} ({{matched}}), {model}",
            "fedhm",
            f"final_acc/{column}",
            baseline,
            f"final_acc/{column}",
        )
        for baseline, name in BASELINES.items()
        for model, column in (("global model", "global"), ("smallest level", "level_{smallest}"))
    ),
    Claim(
        "FedHM's smallest level is within 1 pt of FedHM's global model",
        "fedhm",
        "final_acc/level_{smallest}",
        "fedhm",
        "final_acc/global",
        kind="within",
        margin=0.01,
    ),
    Claim(
        "self-distillation improves FedHM's global model",
        "fedhm_distill",
        "final_acc/global",
        "fedhm",
        "final_acc/global",
    ),
)


#: ``levels.match`` -> the resource a budget-matched baseline's widths were matched on
MATCHED = {"fedhm_params": "parameters", "fedhm_macs": "MACs", "fedhm_memory": "training memory"}


def matched_label(rows: Iterable[Mapping[str, Any]], method: str) -> str:
    """What ``method``'s runs matched their widths on, from their ``levels.match``: ``matched on
    parameters`` (MACs, training memory), ``widths not matched`` (``none``), else which values."""
    values = sorted({str(r.get("levels.match", "not recorded")) for r in rows if r["method"] == method})
    if len(values) == 1 and values[0] in MATCHED:
        return f"matched on {MATCHED[values[0]]}"
    if values == ["none"]:
        return "widths not matched"
    return "levels.match " + (" / ".join(values) or "of no run")


def smallest_level(rows: Iterable[Mapping[str, Any]]) -> str | None:
    """The smallest level (``"0.125"``) among the rows' ``final_acc/level_*`` keys."""
    levels = {k.rsplit("_", 1)[1] for r in rows for k in r if k.startswith("final_acc/level_")}
    return min(levels, key=float) if levels else None


def paired(
    rows: Iterable[Mapping[str, Any]], method: str, column: str, reference: str, ref_column: str
) -> tuple[list[tuple[Any, float]], Estimate | None]:
    """The per-seed differences ``method[column] − reference[ref_column]`` (seeds both have) and
    their :class:`~fedhm_flwr.math.stats.Estimate` (None without a pair)."""
    rows = list(rows)
    ref = {r["seed"]: float(r[ref_column]) for r in rows if r["method"] == reference and r.get(ref_column) is not None}
    diffs = sorted(
        (r["seed"], float(r[column]) - ref[r["seed"]])
        for r in rows
        if r["method"] == method and r.get(column) is not None and r["seed"] in ref
    )
    return diffs, (mean_ci([d for _, d in diffs]) if diffs else None)


def judge(
    rows: list[Mapping[str, Any]], claims: Iterable[Claim] = CLAIMS, prefix: str = "final_acc/"
) -> list[dict[str, Any]]:
    """One dict per claim: ``claim``, ``n``, ``per_seed``, the ``estimate`` (or None), the ``verdict`` and
    ``p`` (:func:`~fedhm_flwr.math.stats.resolution_p`, NaN without an interval), on the accuracies
    ``prefix<model>`` (``final_acc/``: the final evaluation; ``lastk_acc/``: the mean of the last
    evaluations, :func:`fedhm_flwr.reporting.summary_stats.last_evaluations`)."""
    small = smallest_level(rows)
    out = []
    for c in claims:
        text = c.text.replace("{matched}", matched_label(rows, c.reference))
        column, ref_column = (
            col.replace("{smallest}", str(small)).replace("final_acc/", prefix, 1) for col in (c.column, c.ref_column)
        )
        diffs, est = paired(rows, c.method, column, c.reference, ref_column)
        out.append(
            {
                "claim": text,
                "n": len(diffs),
                "per_seed": diffs,
                "estimate": est,
                "verdict": verdict(est, c.kind, c.margin),
                "p": math.nan if est is None else resolution_p(est, c.margin),
                "kind": c.kind,
                "margin": c.margin,
            }
        )
    return out
