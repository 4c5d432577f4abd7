"""The verdicts of ``docs/RESULTS.md``: every claim judged twice, on the final evaluation and on the
mean of the last :data:`LAST_K` evaluations, the label given by the last-K mean after Holm's correction
over the table's verdicts, and a flag wherever the final evaluation says otherwise (#50).

* :func:`verdict_table`: the claims of :data:`fedhm_flwr.reporting.verdicts.CLAIMS` (FedHM against
  FedAvg-smallest, against every baseline variant of the study, its smallest level against its global
  model), per study and setting; a claim whose methods the study does not run is left out.
* :func:`resource_table`: FedHM's levels against each baseline family per resource: against the
  family's runs matched on that resource, level by level, or, where none was matched on it,
  *interpolated* from its parameter-matched runs (:func:`fedhm_flwr.reporting.pareto.resource_comparison`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.studies import LABELS, TITLES
from fedhm_flwr.math.stats import holm
from fedhm_flwr.reporting.pareto import NOT_COMPARABLE, RESOURCES, levels_of, resource_comparison
from fedhm_flwr.reporting.verdicts import CLAIMS, judge, matched_label

#: how many of a run's last evaluations a claim is judged on (the full study evaluates every 5th round:
#: rounds 40, 45 and 50 of 50, the last fifth of its training)
LAST_K = 3
#: the family-wise error rate Holm's correction keeps within each verdict table
ALPHA = 0.05
FINAL, LASTK = "final_acc/", "lastk_acc/"
#: a final gap this far (1 pt, the page's margin) from the last-K mean and outside its interval is flagged
MOVED = 0.01
#: FedHM's baselines by family: its variants, the parameter-matched one first (the one interpolated
#: on a resource no variant was matched on)
FAMILIES = {
    "HeteroFL": ("heterofl", "heterofl_memory"),
    "FedRolex": ("fedrolex", "fedrolex_memory"),
    "FjORD": ("fjord",),
}
RULE_K = (
    f"Every claim is judged twice on the same paired rule: on the final evaluation (the deployable accuracy, "
    f"measured once after the last round) and on each run's mean over its last {LAST_K} evaluations (test-batch "
    "statistics, the only ones measured before the last round; the rounds are stated per study). **The label "
    f"is the last-{LAST_K} mean's, after Holm's step-down correction over all the verdicts of its table** "
    f"(family-wise error rate {ALPHA:.0%}; each verdict's p-value is the smallest α at which its two-sided "
    "1 − α Student-t interval resolves the claim, `fedhm_flwr/math/stats.py: resolution_p`, `holm`): a claim "
    "resolved at 95 % but not after the correction reads *not resolved after Holm* with its uncorrected label. "
    "A verdict is **flagged** where the final evaluation gives another uncorrected label than the "
    f"last-{LAST_K} mean (a resolution or a direction that holds at one round only), or a mean difference "
    f"outside the last-{LAST_K} mean's interval and at least 1 pt from it: a gap that depends on the round it is "
    "read at (the gap by round is tabulated and plotted per setting)."
)


def _diff(est: Any) -> tuple[str, str]:
    if est is None:
        return "", ""
    ci = "n/a (one seed)" if est.n < 2 else f"[{est.low * 100:+.2f}, {est.high * 100:+.2f}]"
    return f"{est.mean * 100:+.2f}", ci


def labelled(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, str]]:
    """Per (final, last-K) pair of judged entries of one table: the cells ``final``, ``final_ci``,
    ``lastk``, ``lastk_ci``, ``p``, ``holm``, ``verdict`` (the last-K label after Holm) and ``flag``."""
    corrected = holm([lastk["p"] for _, lastk in pairs], ALPHA)
    out = []
    for (final, lastk), (adjusted, rejected) in zip(pairs, corrected):
        word = lastk["verdict"]
        resolved = not word.startswith("not ") and word != NOT_COMPARABLE
        label = word if rejected or not resolved else f"not resolved after Holm (uncorrected: {word})"
        fe, ke = final["estimate"], lastk["estimate"]
        both = fe is not None and ke is not None
        sign_differs = both and (fe.mean > 0) != (ke.mean > 0)
        outside = both and ke.n >= 2 and not ke.low <= fe.mean <= ke.high and abs(fe.mean - ke.mean) >= MOVED
        why = [
            *([f"final evaluation: {final['verdict']}"] if final["verdict"] != word else []),
            *(["other sign"] if sign_differs and final["verdict"] != word else []),
            *(
                [f"the final gap lies {abs(fe.mean - ke.mean) * 100:.1f} pt from the last-{LAST_K} mean"]
                if outside
                else []
            ),
        ]
        flag = ", ".join(why)
        out.append(
            {
                **dict(zip(("final", "final_ci"), _diff(fe))),
                **dict(zip(("lastk", "lastk_ci"), _diff(ke))),
                "p": "" if math.isnan(lastk["p"]) else f"{lastk['p']:.3g}",
                "holm": "" if math.isnan(adjusted) else f"{adjusted:.3g}",
                "verdict": label,
                "flag": f"**{flag}**" if flag else "",
            }
        )
    return out


HEAD = (
    f"n | final (pt) | 95 % CI | last {LAST_K} (pt) | 95 % CI | p (last {LAST_K}) | Holm p | "
    f"verdict (last {LAST_K}, Holm) | flag |"
)


def verdict_table(
    all_rows: dict[tuple[str, str], list[dict[str, Any]]], variants: dict[str, tuple[str, ...]]
) -> list[str]:
    """One line per claim, study and setting; ``variants``: study -> the methods it runs."""
    keyed: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = []
    for (study, setting), rows in all_rows.items():
        if not rows:
            continue
        runs = set(variants[study])
        claims = [c for c in CLAIMS if {c.method, c.reference} <= runs]
        for final, lastk in zip(judge(rows, claims, FINAL), judge(rows, claims, LASTK)):
            keyed.append((f"| {final['claim']} | {study} | {TITLES[setting]} |", final["n"], final, lastk))
    cells = labelled([(f, k) for _, _, f, k in keyed])
    lines = [f"| claim | study | setting | {HEAD}", "|---|---|---|" + "---|" * 9]
    for (head, n, _, _), c in zip(keyed, cells):
        lines.append(f"{head} {n} | " + " | ".join(c[k] for k in _CELLS) + " |")
    return lines


_CELLS = ("final", "final_ci", "lastk", "lastk_ci", "p", "holm", "verdict", "flag")


def compared_with(rows: list[dict[str, Any]], entry: dict[str, Any], resource: str) -> str:
    """What a per-resource verdict set FedHM's level against."""
    ref = entry["reference"]
    name = LABELS[ref].split()[0]
    if entry["how"] == "matched":
        return f"{name} {matched_label(rows, ref)}, the same level"
    return f"*interpolated*: {name} {matched_label(rows, ref)}, at FedHM's {RESOURCES[resource]}"


def resource_table(
    all_rows: dict[tuple[str, str], list[dict[str, Any]]],
    cost: Callable[[str, float], str],
    smallest_only: bool = True,
) -> list[str]:
    """FedHM's level (the smallest, or every level) against each baseline family per resource, per study and
    setting (see the module docstring); ``cost`` formats a cost on a resource."""
    keyed: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = []
    for (study, setting), rows in all_rows.items():
        levels = levels_of(rows, "fedhm") if rows else []
        shown = levels[-1:] if smallest_only else levels
        for family, members in FAMILIES.items():
            for resource in RESOURCES:
                pairs = zip(*(resource_comparison(rows, members, resource, p) for p in (FINAL, LASTK)))
                for final, lastk in pairs:
                    if final["level"] not in shown:
                        continue
                    head = (
                        f"| FedHM's level γ = {final['level']} against {family} at equal {RESOURCES[resource]} | "
                        f"{study} | {TITLES[setting]} | {compared_with(rows, final, resource)} | "
                        f"{cost(resource, final['cost'])} |"
                    )
                    keyed.append((head, final["n"], final, lastk))
    cells = labelled([(f, k) for _, _, f, k in keyed])
    lines = [
        f"| claim | study | setting | compared with | FedHM's cost | {HEAD}",
        "|---|---|---|---|---|" + "---|" * 9,
    ]
    for (head, n, _, _), c in zip(keyed, cells):
        lines.append(f"{head} {n} | " + " | ".join(c[k] for k in _CELLS) + " |")
    return lines
