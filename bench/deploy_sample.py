"""Figure 9: the final statistics query's sample, its cost against its accuracy (issue #43 item 2).

After the last round the server asks a seeded sample of ``evaluation.bn_clients`` nodes for every
level's batch-norm sums, each over at most ``evaluation.bn_examples`` of its training examples
(docs/METHODS.md#deployable-statistics). The figure runs the same fixed-seed job (``fedhm run``, as
``make run``) once per sample setting; the runs' final models are the same, tensor by tensor (checked),
so their deployable accuracies differ by the statistics alone. Per setting: the seconds the query
took past the last evaluation, the last round ÷ the median round, and each level's deployable
accuracy against the reference (every node, every example) and against the previous default.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.whole_job import LAST_ROUND_TARGET, _rows, _spawn, last_round_ratio, same_tensors
from fedhm_flwr.config import load_config

#: the exported models' accuracy may move at most this much (points, every level) from the previous
#: default's statistics (10 nodes × 512 examples) when the sample shrinks to make the last round cheap
TOLERANCE_POINTS = 0.5

REFERENCE = "every node, every example"
BEFORE = "previous default"


def settings() -> dict[str, list[str]]:
    """Setting label -> its overrides: the reference, the previous default and today's default."""
    ev = load_config([]).evaluation
    return {
        REFERENCE: ["evaluation.bn_clients=0", "evaluation.bn_examples=0"],
        BEFORE: ["evaluation.bn_clients=10", "evaluation.bn_examples=512"],
        "default": [f"evaluation.bn_clients={ev.bn_clients}", f"evaluation.bn_examples={ev.bn_examples}"],
    }


def _deployable(row: dict[str, Any]) -> dict[str, float]:
    return {k.split("/", 1)[1]: float(v) for k, v in row.items() if k.startswith("deployable_acc/")}


def run_setting(overrides: list[str], tmp: Path, name: str) -> dict[str, Any]:
    """One job; its last row's query seconds, round ratio and deployable accuracies."""
    run_dir = tmp / name
    _spawn([sys.executable, "-m", "fedhm_flwr", "run", "--run-dir", str(run_dir), *overrides], tmp / f"{name}.log")
    rows = _rows(run_dir)
    last = rows[-1]
    return {
        "overrides": overrides,
        "run_dir": str(run_dir),
        "query_past_evaluation_seconds": float(last.get("deploy_stats_seconds", 0.0)),
        "last_round_seconds": float(last["seconds"]),
        "last_round_ratio": last_round_ratio(rows),
        "deployable_acc": _deployable(last),
    }


def max_gap(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest gap between two settings' accuracies over the models both have, in points."""
    return max(abs(a[k] - b[k]) * 100 for k in a.keys() & b.keys())


def figure_deploy_sample(quick: bool) -> dict[str, Any]:
    """The default job (2 rounds when ``quick``) once per sample setting."""
    base = ["rounds=2", "dataset.max_train_examples=6000", "dataset.max_test_examples=2000"] if quick else []
    out: dict[str, Any] = {"quick": quick, "base": base, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="fedhm-bench9-") as name:
        tmp = Path(name)
        for index, (label, overrides) in enumerate(settings().items()):
            out["settings"][label] = run_setting([*base, *overrides], tmp, f"s{index}")
        runs = [Path(s["run_dir"]) / "checkpoint" / "global_model.safetensors" for s in out["settings"].values()]
        out["same_final_models"] = all(same_tensors(runs[0], other) for other in runs[1:])
    ref, before = out["settings"][REFERENCE]["deployable_acc"], out["settings"][BEFORE]["deployable_acc"]
    for s in out["settings"].values():
        s["gap_to_reference_points"] = max_gap(s["deployable_acc"], ref)
        s["gap_to_before_points"] = max_gap(s["deployable_acc"], before)
    return out


def deploy_sample_markdown(f9: dict[str, Any]) -> list[str]:
    """Figure 9's section of the report."""
    levels = sorted(next(iter(f9["settings"].values()))["deployable_acc"], key=lambda k: (k != "global", k))
    L = [
        "## 9. The final statistics query: its sample's cost and accuracy",
        "",
        f"The same fixed-seed job (`fedhm run {' '.join(f9['base']) or '(defaults)'}`) once per sample of the "
        "deployment statistics query (docs/METHODS.md#deployable-statistics). The final models are "
        + ("the same, tensor by tensor" if f9["same_final_models"] else "**not** the same (the figure is void)")
        + "; the deployable accuracies differ by the statistics alone. Targets: every level within "
        f"{TOLERANCE_POINTS:g} points of the previous default's; the last round ≤ {LAST_ROUND_TARGET:g}× "
        "the median round.",
        "",
        "| sample | overrides | query past the last evaluation s | last round ÷ median | "
        + " | ".join(f"deployable {k}" for k in levels)
        + " | largest gap to the reference (points) | largest gap to the previous default (points) |",
        "|---|---|---|---|" + "---|" * len(levels) + "---|---|",
    ]
    for label, s in f9["settings"].items():
        accs = " | ".join(f"{s['deployable_acc'][k]:.4f}" for k in levels)
        L.append(
            f"| {label} | `{' '.join(s['overrides'][len(f9['base']) :])}` | "
            f"{s['query_past_evaluation_seconds']:.2f} | {s['last_round_ratio']:.2f} | {accs} | "
            f"{s['gap_to_reference_points']:.2f} | {s['gap_to_before_points']:.2f} |"
        )
    return L


if __name__ == "__main__":  # python -m bench.deploy_sample [--quick]: the figure alone, as JSON
    print(json.dumps(figure_deploy_sample("--quick" in sys.argv), indent=1))
