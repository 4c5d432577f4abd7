"""The parts of docs/ROBUSTNESS.md that are not the runs' own numbers: the malformed-reply table
from the fuzz campaign's ``results/fuzz/fuzz.json``, and the DP runs' ε by dp-accounting's PLD accountant.

The campaign (``python -m bench.fuzz --minutes N``, written elsewhere) sends the server replies
broken in known ways, class by class, and records per class how many replies were tried, how many
the server refused and why, how many rounds ran on and whether the global model stayed finite.
This module only reads that file and tabulates it (:func:`section`): one row per class, numbers as
the file has them; without the file the section says the campaign has not been run.

The DP runs logged ε from the project's RDP accountant (``fedhm_flwr.math.privacy``); beside it the
page shows ε of the same mechanism by Google's dp-accounting (:func:`pld_epsilon`), computed here from
each run's recorded q, σ, rounds and δ (:func:`dp_parameters`), checked first to give back the RDP ε
the run logged (:func:`pld_text`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "results" / "fuzz" / "fuzz.json"
COMMAND = "python -m bench.fuzz --minutes N"
#: a refusal reason is cut to about this many characters in the table
REASON_WIDTH = 80
#: how many of a class's most frequent refusal reasons the table shows
REASONS_SHOWN = 2
TITLE = "## Malformed replies (fuzz campaign)"


def load(path: Path = FUZZ) -> dict[str, Any] | None:
    """The campaign's record, or None where the file does not exist."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def shorten(text: str, width: int = REASON_WIDTH) -> str:
    """One line, at most ``width`` characters (an ellipsis where cut), safe in a Markdown table."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def top_reasons(reasons: dict[str, int], shown: int = REASONS_SHOWN) -> str:
    """The most frequent refusal reasons with their counts (ties: alphabetical), and how many others."""
    ranked = sorted(reasons.items(), key=lambda kv: (-int(kv[1]), kv[0]))
    if not ranked:
        return "–"
    text = "; ".join(f"{shorten(r)} ({int(n)})" for r, n in ranked[:shown])
    rest = len(ranked) - shown
    return text + (f"; {rest} other reason(s)" if rest > 0 else "")


def row(c: dict[str, Any]) -> str:
    """One class's table row."""
    rounds = int(c["rounds"])
    return (
        f"| `{c['class']}` | {shorten(c.get('what', ''), 120)} | {int(c['tried'])} | {int(c['refused'])} | "
        f"{top_reasons(c.get('reasons') or {})} | {int(c['rounds_survived'])} of {rounds} | "
        f"{int(c['model_finite'])} of {rounds} |"
    )


def section(path: Path = FUZZ) -> list[str]:
    """The page's lines for the campaign in ``path`` (a note naming the command where it is absent)."""
    data = load(path)
    if data is None:
        return [
            TITLE,
            "",
            f"The fuzz campaign has not been run: there is no `results/fuzz/{Path(path).name}`. "
            "Run it with `" + COMMAND + "` (N minutes), then rebuild this page with "
            "`python -m bench.robustness --no-run`.",
            "",
        ]
    code = f"`{data.get('commit')}`" + (" (with uncommitted changes)" if data.get("dirty") else "")
    configs = ", ".join(f"`{c}`" for c in data.get("configs", [])) or "–"
    lines = [
        TITLE,
        "",
        f"Made by `python -m bench.fuzz --minutes {float(data['minutes']):g}` (the campaign's "
        f"`results/fuzz/{Path(path).name}`, tabulated here as recorded): {int(data['replies_tried'])} "
        f"replies tried ({int(data.get('malformed_replies', 0))} of them malformed, the others honest, "
        f"rewritten harmlessly, or delivered twice or astray) over {int(data['rounds'])} rounds, "
        f"{float(data['minutes']):g} minutes, "
        f"at commit {code}, in the configurations {configs}. Totals: {int(data.get('escaped', 0))} "
        f"escaped, {int(data.get('non_finite_models', 0))} non-finite models.",
        "",
        "Per class of malformed reply: the replies tried, how many the server refused, its most "
        "frequent refusal reason(s) with their counts (node-specific numbers in a reason vary), and of "
        "the rounds that received such replies, those the round survived and those after which the "
        "global model was finite.",
        "",
        "| class | what | tried | refused | most frequent reason | rounds survived | model finite |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [row(c) for c in data.get("classes", [])]
    return lines + [""] + LYING


#: what the checks cannot refuse (the page's own words, no figures)
LYING = [
    "## What a lying client can still do",
    "",
    "A reply that has the form of an honest one passes every check above; what its values do is then "
    "limited only by the defences and DP of this page. In particular a client can still:",
    "",
    "- **weigh more than it holds, up to a cap**: a sample-weighted merge (FedAvg, "
    "`method.weight_by_samples`) counts at most the training examples the node reported when it joined "
    "(its node-info answer) and `aggregation.max_examples` (default: the training set's size, when the "
    "dataset is one the project knows). A node that lies when it joins can claim up to that cap; on "
    "devices, set `aggregation.max_examples` to what a device can plausibly hold;",
    "- **claim any classes**: `class-counts` only have to sum to `num-examples`; they decide which "
    "classifier rows its reply covers;",
    "- **report any training figures** (loss, accuracy in [0, 1], seconds): they enter the round's "
    "reported averages, never the model;",
    "- **set the pace of a round**: once `stragglers.quorum` of the nodes answered, the deadline is "
    "`stragglers.factor` times the median time of the answers so far, never under `stragglers.min_seconds`; "
    "answering at once shortens a round only if such answers are most of those in, and staying silent "
    "costs a round at most its deadline, unless fewer than the quorum answer at all (then the round waits "
    "for `timeout`);",
    "- **claim any identity in its node info** (partition id, name, capability: its level follows the "
    "claim); a malformed node-info answer makes it sit out;",
    "- **send any finite values** whose tensors' norms stay under `aggregation.max_norm`: scaled, "
    "sign-flipped or crafted updates are the attacks the tables above measure against the defences.",
    "",
]


# ------------------------------------------------------------------ PLD ε of the DP runs


def dp_parameters(run: dict[str, Any]) -> tuple[float, float, int, float] | None:
    """``(q, σ, rounds, δ)`` of a DP run from its own record (``dp_q``/``dp_sigma``/``dp_rounds`` where
    kept, else its ``fraction_train`` override, ``dp_noise_multiplier``, ``rounds_completed``), or None."""
    overrides = dict(item.split("=", 1) for item in str(run.get("overrides", "")).split() if "=" in item)
    q = run.get("dp_q", overrides.get("fraction_train"))
    sigma = run.get("dp_sigma", run.get("dp_noise_multiplier"))
    rounds = run.get("dp_rounds", run.get("rounds_completed"))
    if None in (q, sigma, rounds, run.get("dp_delta")):
        return None
    return float(q), float(sigma), int(rounds), float(run["dp_delta"])


@functools.cache
def pld_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """ε of ``rounds`` Poisson-sampled Gaussian rounds at ``δ`` by dp-accounting's PLD accountant."""
    import warnings

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import dp_accounting

        accountant = dp_accounting.pld.PLDAccountant()
        accountant.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds
            )
        )
        return float(accountant.get_epsilon(delta))


def pld_text(run: dict[str, Any]) -> str:
    """The PLD ε of a run, only where its parameters reproduce the RDP ε it logged (else –)."""
    from fedhm_flwr.math.privacy import compute_rdp, epsilon_from_rdp

    p = dp_parameters(run)
    if p is None or not math.isclose(
        epsilon_from_rdp(compute_rdp(*p[:3]), p[3])[0], float(run["dp_epsilon"]), rel_tol=1e-6
    ):
        return "–"
    return f"{pld_epsilon(*p):.2f}"


def dp_accounting_version() -> str:
    """``dp-accounting <installed version>``, as the page names the library."""
    from importlib.metadata import version

    return f"dp-accounting {version('dp-accounting')}"
