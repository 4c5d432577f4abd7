"""The model card of an exported level (``fedhm export``): the run's figures for the level and the
card's Markdown. :func:`run_accuracy` reads what the run measured: the level's accuracy on the
server's test set (``evaluation.where`` = server or both) and the clients' federated accuracy of
the level (clients or both: the nodes at that level on their held-out examples, weighted by
examples), from ``summary.json`` and ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedhm_flwr.reporting.results import METRICS_JSONL, SUMMARY_FILE


def run_accuracy(run_dir: Path, level: float) -> dict[str, Any]:
    """The level's figures in the run (None where the run did not measure them)."""
    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    fed = f"fed_acc/level_{level:g}"
    last: dict[str, Any] = {}  # the last round with a federated figure for this level
    try:
        for line in (run_dir / METRICS_JSONL).read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get(fed) is not None:
                last = row
    except (OSError, ValueError):
        pass
    return {
        "final_accuracy": summary.get(f"final_acc/level_{level:g}"),
        "best_accuracy": summary.get(f"best_acc/level_{level:g}"),
        "run_bn_stats": summary.get("bn_stats"),
        # the run's own score of this deployable model with the statistics the export carries
        "final_deployable_accuracy": summary.get(f"final_deployable_acc/level_{level:g}"),
        "deployable_bn_stats": summary.get("deployable_bn_stats"),
        "final_fed_accuracy": summary.get(f"final_{fed}"),
        "best_fed_accuracy": summary.get(f"best_{fed}"),
        "fed_accuracy_round": last.get("round"),
        "fed_accuracy_clients": last.get(f"fed_clients/level_{level:g}"),
        "rounds_completed": summary.get("rounds_completed"),
    }


def test_set_words(dataset: str, examples: int, total: int, max_examples: int, seed: int) -> str:
    """Which test set a figure is on, in words: the dataset, its split and how many of its images."""
    if 0 < max_examples < total:
        part = f"{examples:,} of its {total:,} images, a seeded subset "
        part += f"(dataset.max_test_examples={max_examples}, seed={seed})"
    else:
        part = f"all {examples:,} images"
    return f"the {dataset} test split, {part}"


def _num(x: float | None) -> str:
    return "not recorded" if x is None else f"{x:.4f}"


def _run_rows(card: dict[str, Any]) -> list[str]:
    rows = []
    if card["final_accuracy"] is not None or card.get("final_fed_accuracy") is None:
        rows += [
            f"| final accuracy of this level in the run, server's test set | {_num(card['final_accuracy'])} "
            f"(statistics: {card['run_bn_stats']}) |",
            f"| best accuracy of this level in the run, server's test set | {_num(card['best_accuracy'])} |",
        ]
    if card.get("final_deployable_accuracy") is not None:
        rows.append(
            f"| final deployable accuracy of this level in the run, server's test set | "
            f"{_num(card['final_deployable_accuracy'])} (statistics: {card['deployable_bn_stats']}) |"
        )
    if card.get("final_fed_accuracy") is not None:
        clients = card.get("fed_accuracy_clients")
        where = f"round {card.get('fed_accuracy_round')}" + (
            "" if clients is None else f", {clients:g} client{'s' * (clients != 1)}"
        )
        rows += [
            f"| final federated accuracy of this level in the run: its clients on their held-out examples | "
            f"{_num(card['final_fed_accuracy'])} ({where}) |",
            f"| best federated accuracy of this level in the run | {_num(card['best_fed_accuracy'])} |",
        ]
    return rows


def model_card_markdown(card: dict[str, Any]) -> str:
    macs, ort = card["macs_per_input"], card.get("onnx_runtime")
    lines = [
        f"# {card['method']} · {card['model']} · {card['dataset']} · level {card['level']:g}",
        "",
        f"The deployable model of level {card['level']:g} from the run in `{card['run_dir']}` "
        f"(checkpoint of round {card['checkpoint_round']}).",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {card['parameters']:,} |",
        f"| MACs per input | {'-' if macs is None else f'{macs:,}'} |",
        f"| test set | {card.get('test_set') or 'not on the exporting machine'} |",
        f"| accuracy of this exported model on the test set (PyTorch) | {_num(card['test_accuracy'])} "
        f"({card['test_examples'] or 0:,} images, any batch size) |",
    ]
    if ort:
        lines += [
            f"| accuracy of `model.onnx` in ONNX Runtime, one image at a time | {_num(ort['accuracy'])} "
            f"({ort['examples']:,} images of {ort['data']}) |",
            f"| ONNX Runtime against PyTorch, one image at a time | "
            f"predictions agree on {ort['predictions_agreeing']:,} of {ort['examples']:,}; "
            f"max logit difference {ort['max_abs_logit_difference']:.2g} (tolerance {ort['tolerance']}) |",
        ]
    lines += [
        f"| normalisation statistics | {card['normalisation']['statistics']}: {card['normalisation']['data']} |",
        *_run_rows(card),
        f"| factorized layers (rank) | {len(card['factorized_layers'])} |",
        "",
        "Files: " + ", ".join(f"`{f}`" for f in card["files"].values()),
        "",
    ]
    pre = card.get("preprocessing")
    if pre:
        lines += [
            "## Input",
            "",
            f"{pre['color']} images, {pre['resize']}, {pre['scale']}, normalised with mean {pre['mean']} and "
            f"std {pre['std']} ({pre['layout']}). The model is in eval mode with fixed statistics: "
            "one image at a time gives the same prediction as a batch.",
            "",
        ]
        if pre["class_names"]:
            lines += [
                "Classes (output index order): " + ", ".join(f"{i}: {c}" for i, c in enumerate(pre["class_names"])),
                "",
            ]
    lines += [
        "Load: `fedhm_flwr.ops.tools.export.load_model('model.safetensors')` (the spec is in the file's metadata) "
        "or `torch.export.load('model.pt2').module()`.",
        "",
    ]
    if card.get("onnx_snippet"):
        lines += [
            "## Run it with ONNX Runtime",
            "",
            "One image (`image.png`) in the folder of `model.onnx` (`pip install onnxruntime numpy pillow`):",
            "",
            "```python",
            card["onnx_snippet"],
            "```",
            "",
        ]
    lines += [f"Note: {n}" for n in card["notes"]]
    lines += ["", "## Config", "", "```yaml", card["config"].rstrip(), "```", ""]
    return "\n".join(lines)
