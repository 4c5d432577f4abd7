"""The tables of ``docs/RESULTS.md`` (:mod:`bench.results_page` lays out the page): per setting the
headline, the paired differences against FedHM, the per-level table and the FedHM − HeteroFL sentence, and
the verdicts over every study and setting. Each takes the rows of :func:`bench.results_page.variant_rows`."""

from __future__ import annotations

from typing import Any

from bench.results_verdicts import LAST_K
from bench.studies import LABELS, VARIANTS
from fedhm_flwr.math.stats import mean_ci
from fedhm_flwr.reporting.verdicts import matched_label


def _pct(est: Any) -> str:
    """``80.12 ± 0.34`` (percent; the std only from two values on)."""
    return f"{est.mean * 100:.2f}" + ("" if est.n < 2 else f" ± {est.std * 100:.2f}")


def _pct_ci(est: Any, sign: str = "") -> str:
    return "n/a (one seed)" if est.n < 2 else f"[{est.low * 100:{sign}.2f}, {est.high * 100:{sign}.2f}]"


def paired(rows: list[dict[str, Any]], method: str, reference: str, column: str = "final_acc/global") -> Any:
    """``method − reference`` on the same seeds (an :class:`~fedhm_flwr.math.stats.Estimate`), or None."""
    from fedhm_flwr.reporting.verdicts import paired as paired_diffs

    return paired_diffs(rows, method, column, reference, column)[1]


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """The headline table of one setting: per method, final global accuracy and its mean over the last
    :data:`~bench.results_verdicts.LAST_K` evaluations over seeds, the smallest level's accuracy and size,
    bytes moved and wall time per run."""
    smallest = min(
        (k.rsplit("_", 1)[1] for r in rows for k in r if k.startswith("final_acc/level_")), key=float, default=None
    )
    lines = [
        f"| method | n | final accuracy (%) | 95 % CI | last {LAST_K} evaluations (%) | "
        f"smallest level (γ = {smallest}): accuracy (%) | its parameters | MB moved | minutes per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        runs = [r for r in rows if r["method"] == variant]
        if not runs:
            continue
        final = mean_ci([float(r["final_acc/global"]) for r in runs])
        tail = mean_ci([float(r["lastk_acc/global"]) for r in runs])
        small = [
            float(r[f"final_acc/level_{smallest}"]) for r in runs if r.get(f"final_acc/level_{smallest}") is not None
        ]
        params = runs[0].get(f"params/level_{smallest}")
        if variant in ("fedavg", "fedavg_smallest"):  # one model for every client: no levels to evaluate
            small_cell, params = "", runs[0].get("params/level_1") if variant == "fedavg" else params
        else:
            small_cell = _pct(mean_ci(small)) if small else ""
        mb = mean_ci([float(r["bytes_total"]) / 1e6 for r in runs])
        minutes = mean_ci([float(r["wall_seconds"]) / 60 for r in runs])
        params_cell = f"{params:,}" if params else ""
        lines.append(
            f"| {LABELS[variant]} | {final.n} | {_pct(final)} | {_pct_ci(final)} | {_pct(tail)} | "
            f"{small_cell} | {params_cell} | {mb.mean:,.1f} | {minutes.mean:.1f} |"
        )
    return lines


def level_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per method and level: the level model's parameters (FedHM's at that level beside a
    matched width), MACs and final accuracy over seeds."""
    lines = [
        "| method | level | parameters | FedHM's parameters | MACs | final accuracy (%) | 95 % CI |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        runs = [r for r in rows if r["method"] == variant]
        levels = sorted(
            {k.rsplit("_", 1)[1] for r in runs for k in r if k.startswith("final_acc/level_")}, key=lambda x: -float(x)
        )
        for level in levels:
            acc = mean_ci(
                [float(r[f"final_acc/level_{level}"]) for r in runs if r.get(f"final_acc/level_{level}") is not None]
            )
            first = runs[0]
            cells = [first.get(f"{c}/level_{level}") for c in ("params", "fedhm_params", "macs")]
            lines.append(
                f"| {LABELS[variant]} | {level} | "
                + " | ".join("" if c is None else f"{c:,}" for c in cells)
                + f" | {_pct(acc)} | {_pct_ci(acc)} |"
            )
    return lines


def paired_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"| method − FedHM | n | final accuracy (pt) | 95 % CI | last {LAST_K} evaluations (pt) | 95 % CI | "
        "per seed, final (pt) |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        if variant == "fedhm":
            continue
        final, tail = paired(rows, variant, "fedhm"), paired(rows, variant, "fedhm", "lastk_acc/global")
        if final is None:
            continue
        ref = {r["seed"]: float(r["final_acc/global"]) for r in rows if r["method"] == "fedhm"}
        per_seed = ", ".join(
            f"{r['seed']}: {(float(r['final_acc/global']) - ref[r['seed']]) * 100:+.2f}"
            for r in sorted(rows, key=lambda r: r["seed"])
            if r["method"] == variant and r["seed"] in ref
        )
        lines.append(
            f"| {LABELS[variant]} | {final.n} | {final.mean * 100:+.2f} | {_pct_ci(final, '+')} | "
            f"{tail.mean * 100:+.2f} | {_pct_ci(tail, '+')} | {per_seed} |"
        )
    return lines


def fedhm_vs_heterofl(rows: list[dict[str, Any]]) -> str:
    """The sentence the page owes its reader: FedHM − HeteroFL with its 95 % CI, whatever its sign."""
    est, matched = paired(rows, "fedhm", "heterofl"), matched_label(rows, "heterofl")
    if est is None:
        return "FedHM − HeteroFL: no seed with both runs yet."
    if est.n < 2:
        return f"FedHM − HeteroFL ({matched}), final global accuracy: {est.mean * 100:+.2f} pt on one seed (no CI)."
    verdict = (
        "the interval excludes 0: FedHM is ahead"
        if est.low > 0
        else "the interval excludes 0: HeteroFL is ahead"
        if est.high < 0
        else "the interval contains 0: no difference can be claimed at this number of seeds"
    )
    return (
        f"**FedHM − HeteroFL ({matched}), final global accuracy: {est.mean * 100:+.2f} pt, 95 % CI "
        f"[{est.low * 100:+.2f}, {est.high * 100:+.2f}] over {est.n} paired seeds** ({verdict})."
    )
