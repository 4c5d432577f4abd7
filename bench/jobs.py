"""Figures 6 and 7, measured on whole in-process runs of the default job: the wire dtype's bytes
and accuracy cost, and the checkpoint's time against the round's."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from fedhm_flwr.config import load_config


def figure_wire(quick: bool) -> dict[str, Any]:
    """``wire.dtype``: bytes per parameter both ways and the accuracy cost, the default job
    (FedHM, CNN, Fashion-MNIST, 20 clients, half sampled) for a few rounds in process, the same
    seed for every dtype."""
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run

    rounds = 2 if quick else 3
    common = [f"rounds={rounds}", "evaluation.levels=false"] + (
        ["dataset.max_train_examples=6000", "dataset.max_test_examples=2000"] if quick else []
    )
    out: dict[str, Any] = {"rounds": rounds, "overrides": common, "dtypes": {}}
    for dtype in ("float32", "float16", "bfloat16"):
        cfg = load_config(common + [f"wire.dtype={dtype}"])
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp))
            wall = time.perf_counter() - t0
            rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        out["dtypes"][dtype] = {
            "bytes_sent": sum(r["bytes_sent"] for r in rows),
            "bytes_received": sum(r["bytes_received"] for r in rows),
            "final_acc": rows[-1]["acc/global"],
            "final_loss": rows[-1]["loss/global"],
            "wall_seconds": wall,
            "summary_final_acc": summary.get("final_acc/global"),
        }
    ref = out["dtypes"]["float32"]
    for row in out["dtypes"].values():
        row["bytes_ratio"] = (row["bytes_sent"] + row["bytes_received"]) / (ref["bytes_sent"] + ref["bytes_received"])
        row["acc_cost_pt"] = 100 * (ref["final_acc"] - row["final_acc"])
    return out


def figure_checkpoint(quick: bool) -> dict[str, Any]:
    """Checkpoint time ÷ round time (goal < 5 %): the default job's FedHM with the CNN and with
    ResNet-18 on Fashion-MNIST, in process, a checkpoint every round (``checkpoint.every=1``,
    the default: the model and the strategy state written and renamed, fsync'ed). Both times are
    the run's own: each row's ``seconds`` and the summary's ``checkpoint_seconds``. The data is
    cut (fewer examples per client), so the rounds are shorter than the default job's: the
    ratio is an upper bound of the default job's."""
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run

    rounds, examples = (2, 1000) if quick else (3, 4000)
    out: dict[str, Any] = {
        "rounds": rounds,
        "max_train_examples": examples,
        "goal": "checkpoint ÷ round < 5 %",
        "models": {},
    }
    for model in ("cnn", "resnet18"):
        cfg = load_config(
            [
                f"model={model}",
                f"rounds={rounds}",
                f"dataset.max_train_examples={examples}",
                "dataset.max_test_examples=1000",
                "evaluation.levels=false",
                "checkpoint.every=1",
            ]
        )
        with tempfile.TemporaryDirectory() as tmp:
            summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp))
            size = (Path(tmp) / "checkpoint" / "global_model.safetensors").stat().st_size
        out["models"][model] = {
            "checkpoint_seconds": summary["checkpoint_seconds"] / rounds,
            "round_seconds": summary["seconds_rounds"] / rounds,
            "checkpoint_bytes": size,
            "ratio": summary["checkpoint_seconds"] / summary["seconds_rounds"],
        }
    return out


def checkpoint_markdown(f7: dict[str, Any]) -> list[str]:
    L = [
        f"## 7. Checkpoint time ÷ round time (a checkpoint every round; {f7['rounds']} rounds, "
        f"{f7['max_train_examples']:,} training examples: an upper bound)",
        "",
        f"Goal: {f7['goal']}.",
        "",
        "| model | checkpoint (MB) | checkpoint s / round | round s | checkpoint ÷ round |",
        "|---|---|---|---|---|",
    ]
    for model, r in f7["models"].items():
        L.append(
            f"| {model} | {r['checkpoint_bytes'] / 1e6:.1f} | {r['checkpoint_seconds']:.3f} | "
            f"{r['round_seconds']:.2f} | **{100 * r['ratio']:.2f} %** |"
        )
    return L + [""]


def wire_markdown(f6: dict[str, Any]) -> list[str]:
    """Figure 6's section of the report."""
    L: list[str] = []
    L += [
        f"## 6. Wire dtype: bytes and accuracy cost (default job, {f6['rounds']} rounds, in process, same seed)",
        "",
        "| wire.dtype | bytes sent + received | ÷ float32 | final accuracy | cost vs float32 (pt) |",
        "|---|---|---|---|---|",
    ]
    for dtype, r in f6["dtypes"].items():
        L.append(
            f"| {dtype} | {r['bytes_sent'] + r['bytes_received']:,} | {r['bytes_ratio']:.3f} | "
            f"{r['final_acc']:.4f} | {r['acc_cost_pt']:+.2f} |"
        )
    L.append("")
    return L
