"""Transformer-track comparison tables: FedLoRA and HeteroTune against their baselines.

``python -m bench.transformer_track [--track text|image|both] [--group fedlora|heterotune|both]``

Every run goes through the same server round, messages and client handlers as ``flwr run``, in
one process over :class:`fedhm_flwr.ops.apps.local_grid.LocalGrid` (no Ray: on a shared 2-core CPU the
simulation engine's start-up would cost more than the runs). A run whose ``summary.json``
exists is not run again (``--fresh`` to redo), so an interrupted sweep continues where it
stopped. Results go to ``<out>/<track>/<run>/`` (default ``~/fedhm-outputs/transformer-track``);
the Markdown tables, with the frozen-backbone probes of ``python -m fedhm_flwr.ops.tools.pretrain probe``
when their JSON is given (``--probes``), to ``bench/reports/transformer_track.md``.

Columns: final test accuracy of each rank's / type's deployable model (FedLoRA: the rank-r
truncation of the global ΔW; HeteroTune: the type's DeMA merged into plain adapters) and of the
global model (FedLoRA: dense ΔW; HeteroTune: the largest type); exact trainable parameters per
client of each rank / type (adapters and head apart); bytes one client sends per round
(``ArrayRecord.count_bytes`` of its reply, what the run's byte counters add up); all bytes the
run moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TEXT = (
    "model=minilm dataset=sentiment num_clients=8 fraction_train=0.5 dataset.max_train_examples=640 "
    "dataset.max_test_examples=400 rounds=5 train.batch_size=16 evaluation.every=5 "
    "evaluation.batch_size=100 partition.scheme=dirichlet partition.alpha=0.5"
)
IMAGE = (
    "model=vit dataset=fashion_mnist num_clients=10 fraction_train=0.5 dataset.max_train_examples=5000 "
    "dataset.max_test_examples=2000 rounds=20 train.batch_size=32 evaluation.every=20 "
    "evaluation.batch_size=500 partition.scheme=dirichlet partition.alpha=0.5"
)
TRACKS = {
    "text": TEXT,
    "text-iid": TEXT.replace("partition.scheme=dirichlet partition.alpha=0.5", "partition.scheme=iid"),
    "image": IMAGE,
}
#: AdamW learning rate of full fine-tuning (LoRA / adapters: the methods' default method.lr = 1e-3)
FULL_LR = {"text": 1e-4, "text-iid": 1e-4, "image": 3e-4}
#: HeteroTune's bottleneck h per track: the paper's h = 128 sits below its ViT widths (192-1024); the
#: toy ViTs here are 16-64 wide, so h = 16 (text: 64, MiniLM is 384 wide)
BOTTLENECK = {"text": 64, "text-iid": 64, "image": 16}
THREE = "levels.ratios=[1,0.5,0.25] levels.proportions=[1,1,1]"

#: group -> [(run name, label, overrides)]
RUNS: dict[str, list[tuple[str, str, str]]] = {
    "fedlora": [
        ("fedlora", "FedLoRA (heterogeneous ranks 16/8/4/2)", "method=fedlora"),
        ("lora16", "LoRA rank 16 (homogeneous)", "method=fedlora levels.ratios=[1] levels.proportions=[1]"),
        ("lora8", "LoRA rank 8 (homogeneous)", "method=fedlora levels.ratios=[0.5] levels.proportions=[1]"),
        ("lora4", "LoRA rank 4 (homogeneous)", "method=fedlora levels.ratios=[0.25] levels.proportions=[1]"),
        ("lora2", "LoRA rank 2 (homogeneous)", "method=fedlora levels.ratios=[0.125] levels.proportions=[1]"),
        (
            "full",
            "Full fine-tuning",
            "method=fedlora method.mode=full levels.ratios=[1] levels.proportions=[1] method.lr={full_lr}",
        ),
        ("fedlora_random", "FedLoRA over a *random* frozen backbone", "method=fedlora model.backbone=random"),
    ],
    "heterotune": [
        ("heterotune", "HeteroTune (DeMA + CMGA)", f"method=heterotune {THREE} method.bottleneck={{h}}"),
        ("no_cmga", "HeteroTune w/o CMGA", f"method=heterotune method.cmga=false {THREE} method.bottleneck={{h}}"),
        ("homo", "Homo-Training", f"method=heterotune method.bank=false {THREE} method.bottleneck={{h}}"),
        # one type everywhere: plain adapters (a one-member bank would merge away and CMGA is the identity)
        (
            "allsmall",
            "AllSmall",
            "method=heterotune levels.ratios=[0.25] levels.proportions=[1] method.bank=false method.bottleneck={h}",
        ),
        (
            "alllarge",
            "AllLarge",
            "method=heterotune levels.ratios=[1] levels.proportions=[1] method.bank=false method.bottleneck={h}",
        ),
    ],
}


def run_one(out_dir: Path, overrides: str) -> dict[str, Any]:
    from fedhm_flwr.config import load_config
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run

    cfg = load_config(overrides)
    return run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, out_dir)


def majority_accuracy(track: str) -> float:
    """Accuracy of always predicting the most frequent class on the track's test subset."""
    from fedhm_flwr.config import data_spec, load_config
    from fedhm_flwr.data import test_dataset

    cfg = load_config(f"{TRACKS[track]} method=fedlora")
    counts = test_dataset(data_spec(cfg), data_dir=cfg.dataset.data_dir).class_counts()
    return float(counts.max() / counts.sum())


def _fmt_acc(x: Any) -> str:
    return "–" if x is None else f"{100 * float(x):.1f}"


def _int(x: Any) -> str:
    return f"{int(x):,}"


def fedlora_table(results: dict[str, dict[str, Any]]) -> str:
    ranks = [(1.0, 16), (0.5, 8), (0.25, 4), (0.125, 2)]
    head = (
        "| method | acc r=16 | acc r=8 | acc r=4 | acc r=2 | acc global | trainable params per client "
        "(adapters + head) | bytes sent per client per round | bytes moved in the run |"
    )
    lines = [head, "|" + "---|" * 9]
    for name, label, _ in RUNS["fedlora"]:
        s = results.get(name)
        if s is None:
            continue
        costs = s["level_costs"]
        accs = [_fmt_acc(s.get(f"final_acc/level_{g:g}")) if f"{g:g}" in costs else "–" for g, _ in ranks]
        if name == "full":
            accs = ["–"] * 4
        params = " / ".join(
            f"{_int(c['adapter_params'])} + {_int(c['head_params'])}"
            if c["adapter_params"]
            else f"{_int(c['params'])} (all)"
            for c in costs.values()
        )
        sent = " / ".join(_int(c["bytes_up"]) for c in costs.values())
        lines.append(
            f"| {label} | {' | '.join(accs)} | {_fmt_acc(s.get('final_acc/global'))} | {params} | {sent} | "
            f"{_int(s.get('bytes_total', 0))} |"
        )
    return "\n".join(lines)


def heterotune_table(results: dict[str, dict[str, Any]], names: tuple[str, str, str]) -> str:
    types = [(1.0, names[0]), (0.5, names[1]), (0.25, names[2])]
    head = (
        f"| method | acc {names[0]} | acc {names[1]} | acc {names[2]} | acc avg | trainable params per client "
        f"(adapters + share + head; {'/'.join(names)}) | bytes sent / received per client per round | "
        f"bytes moved in the run |"
    )
    lines = [head, "|" + "---|" * 8]
    for name, label, _ in RUNS["heterotune"]:
        s = results.get(name)
        if s is None:
            continue
        costs = s["level_costs"]
        accs = [s.get(f"final_acc/level_{g:g}") if f"{g:g}" in costs else None for g, _ in types]
        present = [a for a in accs if a is not None]
        avg = sum(present) / len(present) if present else None
        params = " / ".join(
            f"{_int(c['adapter_params'])} + {_int(c['share_params'])} + {_int(c['head_params'])}"
            for c in costs.values()
        )
        moved = " / ".join(f"{_int(c['bytes_up'])} ↑ {_int(c['bytes_down'])} ↓" for c in costs.values())
        lines.append(
            f"| {label} | {' | '.join(_fmt_acc(a) for a in accs)} | {_fmt_acc(avg)} | {params} | {moved} | "
            f"{_int(s.get('bytes_total', 0))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transformer_track",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--track", choices=("text", "text-iid", "image", "both", "all"), default="both")
    parser.add_argument("--group", choices=("fedlora", "heterotune", "both"), default="both")
    parser.add_argument("--only", nargs="*", default=None, help="run names, e.g. fedlora lora4")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("FEDHM_OUTPUT_ROOT", Path.home() / "fedhm-outputs")) / "transformer-track",
    )
    parser.add_argument(
        "--report", type=Path, default=Path(__file__).resolve().parent / "reports" / "transformer_track.md"
    )
    parser.add_argument("--probes", type=Path, nargs="*", default=[], help="JSON files of `pretrain probe --json`")
    parser.add_argument("--fresh", action="store_true", help="redo runs that already have a summary")
    parser.add_argument("--tables-only", action="store_true", help="only rebuild the report from finished runs")
    args = parser.parse_args(argv)
    tracks = {"both": ["text", "image"], "all": list(TRACKS)}.get(args.track, [args.track])
    groups = ["fedlora", "heterotune"] if args.group == "both" else [args.group]
    for track in tracks:
        for group in groups:
            for name, _label, extra in RUNS[group]:
                if args.tables_only or (args.only is not None and name not in args.only):
                    continue
                out = args.out / track / name
                if (out / "summary.json").is_file() and not args.fresh:
                    continue
                if out.exists():
                    import shutil

                    shutil.rmtree(out)
                t0 = time.perf_counter()
                extra = extra.format(full_lr=FULL_LR[track], h=BOTTLENECK[track])
                print(f"== {track} / {name}: {TRACKS[track]} {extra}", flush=True)
                run_one(out, f"{TRACKS[track]} {extra}")
                print(f"== {track} / {name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    parts = [
        "# Transformer track: FedLoRA and HeteroTune against their baselines",
        "",
        "Generated by `python -m bench.transformer_track` (one seed, small CPU-sized runs; see the settings).",
        "Accuracies are final test accuracies in %, from one seed on a test subset (400 texts: one standard",
        "error is about 2 points; 2000 images: about 1 point); differences smaller than that are noise.",
        "FedLoRA's per-rank columns are the rank-r truncations of the one global ΔW (heterogeneous run) or",
        "the rank of a homogeneous run; HeteroTune's per-type columns are each type's deployable model",
        "(its DeMA merged exactly into plain adapters). Parameters are exact trainable counts per client",
        "(`python -m fedhm_flwr.ops.tools.cost_table` prints the same); bytes are what the run's counters measure.",
        "",
    ]
    for track in TRACKS:
        results = {}
        for group in RUNS.values():
            for name, _, _ in group:
                path = args.out / track / name / "summary.json"
                if path.is_file():
                    results[name] = json.loads(path.read_text())
        if not results:
            continue
        title = {
            "text": "Text: MiniLM-L6 (packaged, frozen), sentiment, Dirichlet(0.5) partition",
            "text-iid": "Text: MiniLM-L6 (packaged, frozen), sentiment, IID partition",
            "image": "Image: pre-trained ViTs (make pretrain), Fashion-MNIST, Dirichlet(0.5) partition",
        }[track]
        parts += [
            f"## {title}",
            "",
            f"Settings: `{TRACKS[track]}`. Majority-class accuracy of this test subset: "
            f"{100 * majority_accuracy(track):.1f}.",
            "",
        ]
        if any(n in results for n, _, _ in RUNS["fedlora"]):
            parts += ["### FedLoRA", "", fedlora_table(results), ""]
        if any(n in results for n, _, _ in RUNS["heterotune"]):
            names = (
                ("depth 6", "depth 3", "depth 2") if track.startswith("text") else ("width 64", "width 32", "width 16")
            )
            parts += ["### HeteroTune", "", heterotune_table(results, names), ""]
    probes = [row for p in args.probes for row in json.loads(Path(p).read_text())]
    if probes:
        from fedhm_flwr.ops.tools.pretrain import markdown

        parts += ["## Does pre-training matter? Frozen-backbone (linear probe) accuracy", "", markdown(probes), ""]
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("\n".join(parts))
    print(f"wrote {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
