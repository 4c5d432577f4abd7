"""Per-level cost table, without training.

``python -m fedhm_flwr.inspect [HYDRA OVERRIDES ...]`` composes the same configuration as a run
and prints one row per level: the level's ratio, its exact integer parameter count, its MACs for
one input and the bytes of the payload a client of that level receives (and sends back) per
round. ``--json`` prints the rows as JSON instead. Everything is counted from shapes on PyTorch's meta
device: no weight is allocated and no SVD computed (a ResNet-34 table in about a second). A method
whose payload needs values (PriSM samples kernels by singular value, FedLoRA/HeteroTune load
pre-trained weights) falls back to real tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from fedhm_flwr.config import ConfigError, load_config, model_spec
from fedhm_flwr.models import build_model


#: Methods whose level models and payloads are determined by shapes alone: counted on the meta device.
SHAPE_ONLY = frozenset({"fedhm", "heterofl", "fedrolex", "fedavg"})


def level_rows(overrides: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    """(config, one dict per level: level, params, macs, payload_bytes)."""
    from strategies import STRATEGIES  # the strategies define what a level's model is

    cfg = load_config(overrides)
    spec = model_spec(cfg)
    if cfg.method.name not in SHAPE_ONLY:  # payloads that depend on values
        return cfg, _rows(cfg, spec, STRATEGIES[cfg.method.name](cfg, spec))
    with torch.device("meta"):  # shapes only: no weight is allocated, no SVD computed
        return cfg, _rows(cfg, spec, STRATEGIES[cfg.method.name](cfg, spec))


def _rows(cfg: Any, spec: dict[str, Any], strategy: Any) -> list[dict[str, Any]]:
    torch.manual_seed(int(cfg.seed))
    state = strategy.initial_state(int(cfg.seed)) or build_model(spec).state_dict()  # FedLoRA/HeteroTune keep their own
    strategy.begin_round(1, state)
    rows = []
    for index, level in enumerate(strategy.levels):
        cost = strategy.level_cost(index)
        _, payload, _ = strategy.level_payload(index, state)
        rows.append({
            "level": f"g{index + 1}",
            "ratio": level,
            **{k: int(v) for k, v in cost.items() if k != "bytes"},
            "payload_bytes": int(sum(t.numel() * t.element_size() for t in payload.values())),
        })
    return rows


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_table(cfg: Any, rows: list[dict[str, Any]]) -> str:
    head = f"method {cfg.method.name} | model {cfg.model.arch} (width {cfg.model.get('width')}) | dataset {cfg.dataset.name}"
    extra = [k for k in rows[0] if k not in ("level", "ratio", "params", "macs", "payload_bytes")]
    cols = ["level", "ratio", "parameters", "params (M)", "MACs / input", "payload bytes"] + extra
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["level"], f"{r['ratio']:g}", f"{r['params']:,}", f"{r['params'] / 1e6:.2f}",
                 _human(r["macs"]) if "macs" in r else "-", _human(r["payload_bytes"])]
        cells += [f"{r[k]:,}" for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhm_flwr.inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=resnet18 dataset=cifar10")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    try:
        cfg, rows = level_rows(args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else format_table(cfg, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
