"""PriSM vs OrthDrop vs uniform sampling (and FedAvg on the full model as the reference), on the
same work; writes a Markdown table.

Every run goes through the real round (strategy, Flower messages, client handlers) on the
in-process grid (``fedhm_flwr.ops.apps.local_grid``), with the same data, partitions, seed, clients, rounds
and learning rate; only the method changes. Settings (the paper's, section 4.2 / 4.3):

* ``homogeneous``: every client keeps 20 % of the principal kernels (``levels.ratios=[0.2]``);
* ``heterogeneous``: 40 % of the clients at 0.4, 60 % at 0.2.

    python bench/prism_compare.py                       # both settings -> bench/reports/prism_compare.md
    python bench/prism_compare.py --setting homogeneous --rounds 5 --softmax train.lr=0.1

Costs are per client and round at the smallest level: parameters sent, MACs per input, and the
activation memory of one training batch (float32 outputs of every leaf module). Accuracy is the
server's test set with test-batch statistics (sBN); one seed, so differences of a point or two are
noise at this scale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedhm_flwr.config import load_config, model_spec
from fedhm_flwr.models import build_model, input_shape
from fedhm_flwr.models.costs import activation_elements
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run

SETTINGS = {
    "homogeneous": "levels.ratios=[0.2] levels.proportions=[1]",
    "heterogeneous": "levels.ratios=[0.4,0.2] levels.proportions=[0.4,0.6]",
}
METHODS = [  # (label, overrides)
    ("PriSM (p ∝ σ^κ)", "method=prism method.sampling=prism"),
    ("PriSM + U-subset", "method=prism method.sampling=prism method.u_subset=true"),
    ("OrthDrop (top-k)", "method=prism method.sampling=orthdrop"),
    ("uniform sampling", "method=prism method.sampling=uniform"),
]
SOFTMAX = ("softmax(σ) sampling", "method=prism method.sampling=softmax")
REFERENCE = ("FedAvg, full model", "method=fedavg method.variant=full")


def _work(args: argparse.Namespace) -> str:
    """The overrides every run shares."""
    return (
        f"rounds={args.rounds} num_clients={args.clients} fraction_train={args.fraction} "
        f"dataset.max_train_examples={args.train_examples} dataset.max_test_examples={args.test_examples} "
        f"seed={args.seed} " + " ".join(args.overrides)
    )


def _full_activation_bytes(cfg: Any) -> float:
    spec = model_spec(cfg)
    with torch.device("meta"):
        acts = activation_elements(build_model(spec, spectral_init=False), input_shape(spec))
    return 4.0 * int(cfg.train.batch_size) * acts


def one_run(label: str, overrides: str, root: Path, clients: int) -> dict[str, Any]:
    cfg = load_config(overrides)
    out = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    t0 = time.perf_counter()
    summary = run(LocalGrid(clients, client_handlers()), cfg, out / "run")
    wall = time.perf_counter() - t0
    smallest = f"{min(float(r) for r in summary['levels']):g}"
    cost = summary["level_costs"][smallest]
    acts = cost.get("activations", _full_activation_bytes(cfg))
    return {
        "label": label,
        "levels": " / ".join(f"{float(r):g}" for r in summary["levels"]),
        "final": summary["final_acc/global"],
        "best": summary["best_acc/global"],
        "level": summary.get(f"final_acc/level_{smallest}"),
        "params": cost["params"],
        "macs": cost["macs"],
        "activations": acts,
        "bytes": summary["bytes_total"],
        "seconds": wall,
    }


def _fmt(x: float, unit: str = "") -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def table(setting: str, rows: list[dict[str, Any]], work: str) -> str:
    head = (
        f"### {setting}\n\nSame work for every row: `{work.strip()}`.\n\n"
        "| method | keep ratios | final acc (global) | best acc (global) | final acc (top-k sub-model, smallest keep) "
        "| params sent / client (smallest keep) | MACs / input (smallest keep) | activations / batch (smallest keep) "
        "| bytes moved (run) | wall s |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        level = "-" if r["label"].startswith("FedAvg") or r["level"] is None else f"{r['level']:.3f}"
        lines.append(
            f"| {r['label']} | {r['levels'] if not r['label'].startswith('FedAvg') else '1 (full)'} "
            f"| {r['final']:.3f} | {r['best']:.3f} | {level} | {_fmt(r['params'])} | {_fmt(r['macs'])} "
            f"| {_fmt(r['activations'], 'B')} | {_fmt(r['bytes'], 'B')} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides shared by every run")
    parser.add_argument("--setting", choices=[*SETTINGS, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--train-examples", type=int, default=3000)
    parser.add_argument("--test-examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--softmax", action="store_true", help="also the softmax(sigma) ablation")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("reports") / "prism_compare.md")
    args = parser.parse_args(argv)
    settings = list(SETTINGS) if args.setting == "both" else [args.setting]
    methods = METHODS + ([SOFTMAX] if args.softmax else [])
    work = _work(args)
    sections = [
        "# PriSM vs OrthDrop vs uniform sampling (Fashion-MNIST, CNN)\n",
        f"Generated by `python bench/prism_compare.py {' '.join(argv if argv is not None else sys.argv[1:])}`."
        " One seed; in-process grid (the real round without Ray).\n",
    ]
    with tempfile.TemporaryDirectory(prefix="prism-compare-") as tmp:
        root = Path(tmp)
        reference: dict[str, Any] | None = None
        for setting in settings:
            shared = f"{work} {SETTINGS[setting]}"
            rows = [one_run(label, f"{shared} {extra}", root, args.clients) for label, extra in methods]
            if reference is None:  # the full model does not depend on the keep ratios: run it once
                reference = one_run(REFERENCE[0], f"{shared} {REFERENCE[1]}", root, args.clients)
            rows.append(reference)
            sections.append(table(setting, rows, shared))
            print(sections[-1], flush=True)
    text = "\n\n".join(sections) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
