"""Figure 11: level evaluation's share of the default job's round time (issue #53).

The default job (``make run``: conf/config.yaml's defaults, FedHM, the CNN on Fashion-MNIST, 10 rounds, 20
clients) as ``fedhm run`` runs it from a shell. Every round's row (``metrics.jsonl``) holds the round's wall
seconds (``seconds``) and its evaluation's (``eval_seconds``: the global model and every level's deployable
model scored on the server's test set, ``evaluation.where=server``); the figure is their quotient per round
and its median over the rounds, against :data:`TARGET`.

    python -m bench.run --only 11          # (make bench ARGS="--only 11"); --quick: 2 small rounds, a smoke test
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.whole_job import _rows, _spawn

TARGET = 0.12  # level evaluation's seconds ÷ the round's, median over the rounds (issue #53)
QUICK = ["rounds=2", "num_clients=4", "dataset.max_train_examples=2000", "dataset.max_test_examples=500"]


def eval_shares(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per evaluated round: (round, eval_seconds, seconds, eval_seconds ÷ seconds); their median share.
    A row without ``eval_seconds`` (a round not evaluated) is left out; no evaluated round: no median."""
    rounds = [
        {
            "round": int(r["round"]),
            "eval_seconds": float(r["eval_seconds"]),
            "seconds": float(r["seconds"]),
            "share": float(r["eval_seconds"]) / float(r["seconds"]),
        }
        for r in rows
        if "eval_seconds" in r and float(r["seconds"]) > 0
    ]
    median = statistics.median(r["share"] for r in rounds) if rounds else None
    return {"rounds": rounds, "median_share": median, "target": TARGET}


def figure_eval_share(quick: bool) -> dict[str, Any]:
    """The default job (``QUICK``: a smoke test), its per-round evaluation shares and their median."""
    overrides = QUICK if quick else []
    with tempfile.TemporaryDirectory(prefix="fedhm-bench11-") as name:
        tmp = Path(name)
        run_dir = tmp / "default"
        _spawn(
            [sys.executable, "-m", "fedhm_flwr", "run", "--no-progress", "--run-dir", str(run_dir), *overrides],
            tmp / "default.log",
        )
        rows = _rows(run_dir)
    return {"quick": quick, "overrides": overrides, **eval_shares(rows)}


def eval_share_markdown(f11: dict[str, Any]) -> list[str]:
    """Figure 11's section of the report."""
    median = f11["median_share"]
    verdict = "no evaluated round" if median is None else f"**{100 * median:.1f} %**"
    met = "" if median is None else (" (met)" if median <= f11["target"] else " (**missed**)")
    L = [
        "## 11. Level evaluation's share of a round",
        "",
        f"The default job (`fedhm run {' '.join(f11['overrides'])}`): each round's `eval_seconds` (the global "
        "model and every level's deployable model scored on the server's test set) ÷ its `seconds`, from "
        f"`metrics.jsonl`. Median over the rounds: {verdict}; target ≤ {100 * f11['target']:g} %{met}.",
        "",
        "| round | evaluation s | round s | share |",
        "|---|---|---|---|",
    ]
    L += [
        f"| {r['round']} | {r['eval_seconds']:.2f} | {r['seconds']:.2f} | {100 * r['share']:.1f} % |"
        for r in f11["rounds"]
    ]
    return L
