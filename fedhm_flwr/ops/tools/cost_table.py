"""Per-level cost table, without training.

``python -m fedhm_flwr.ops.tools.cost_table [HYDRA OVERRIDES ...]`` composes the same configuration as a run
and prints one row per level: the level's ratio, its exact integer parameter count, its MACs for
one input and the bytes of the payload a client of that level receives (and sends back) per
round. For FedHM (and FedAvg of family fedhm) a second table gives the plan: every layer the
model's factorization rule selects (``model.factorize``, :mod:`fedhm_flwr.models.rules`), its
weight shape and its rank and parameter count at each level. ``--json`` prints the rows as JSON
instead. Everything is counted from shapes on PyTorch's meta device: no weight is allocated and no SVD computed (a
ResNet-34 table in about a second). A method whose payload needs values (PriSM samples kernels by singular value,
FedLoRA/HeteroTune load pre-trained weights) falls back to real tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

import torch
from omegaconf import DictConfig
from torch import Tensor

from fedhm_flwr.config import ConfigError, RunOptions, load_config, model_spec, run_options
from fedhm_flwr.config.options.factorized import FedHMOptions
from fedhm_flwr.models import build_model, count_parameters, shape_device
from fedhm_flwr.models.matching import fedhm_level_params
from fedhm_flwr.models.rules import select_layers
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.method import Method
from fedhm_flwr.server.registry import STRATEGIES  # the strategies define what a level's model is

#: Methods whose level models and payloads are determined by shapes alone: counted on the meta device.
SHAPE_ONLY = frozenset({"fedhm", "heterofl", "fedrolex", "fedavg"})


def level_rows(overrides: list[str]) -> tuple[DictConfig, list[dict[str, Any]]]:
    """(config, one dict per level: level, params, macs, payload_bytes)."""
    cfg = load_config(overrides)
    return cfg, table_rows(run_options(cfg), model_spec(cfg))


def table_rows(opts: RunOptions, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per level of the run ``opts`` of the model ``spec`` (see :func:`level_rows`)."""
    if opts.method.name not in SHAPE_ONLY:  # payloads that depend on values
        return _rows(opts, spec, STRATEGIES[opts.method.name](opts, spec).method)
    with shape_device(spec, small_on_cpu=False):  # shapes only: no weight allocated, no SVD (meta; else the CPU)
        return _rows(opts, spec, STRATEGIES[opts.method.name](opts, spec).method)


def _rows(opts: RunOptions, spec: dict[str, Any], method: Method) -> list[dict[str, Any]]:
    torch.manual_seed(opts.seed)
    state = method.initial_state(opts.seed) or build_model(spec).state_dict()  # FedLoRA/HeteroTune keep their own
    method.begin_round(1, state)
    full = count_parameters(build_model(spec, spectral_init=False)) if opts.method.name in SHAPE_ONLY else None
    rows: list[dict[str, Any]] = []
    for index, level in enumerate(method.levels):
        cost = method.level_cost(index)
        _, payload, _ = method.level_payload(index, state)
        rows.append(
            {
                "level": f"g{index + 1}",
                "ratio": level,
                **{k: int(v) for k, v in cost.items() if k != "bytes"},
                "payload_bytes": int(sum(t.numel() * t.element_size() for t in payload.values())),
            }
        )
        if full:
            rows[-1]["of_full"] = rows[-1]["params"] / full
    return rows


def plan_rows(opts: RunOptions, spec: dict[str, Any]) -> list[dict[str, Any]] | None:
    """FedHM's plan: one dict per selected layer (layer, type, shape, params, ranks, level_params:
    one entry per level, rank None = full), or None for a method that factorizes nothing.

    A factorized layer's weight is ``A (rows × r)`` and ``B (r × cols)`` of its layer matrix
    (conv ``(n·k, m·k)``, linear ``(out, in)``): ``r · (rows + cols)`` parameters.
    """
    with shape_device(spec):
        inner = STRATEGIES[opts.method.name](opts, spec).method  # FedAvg of FedHM's family is a FedHM too
        if not isinstance(inner, FedHM):
            return None
        model = build_model(spec, spectral_init=False)
    rows = []
    for name in select_layers(model):
        module = model.get_submodule(name)
        weight = cast(Tensor, module.weight)  # (torch types a module's own attributes as Tensor | Module)
        shape = tuple(weight.shape)
        rows_, cols = (shape[0] * shape[2], shape[1] * shape[3]) if len(shape) == 4 else shape
        ranks = [r.get(name) for r in inner.ranks]
        rows.append(
            {
                "layer": name,
                "type": type(module).__name__,
                "shape": list(shape),
                "params": int(weight.numel()),
                "ranks": ranks,
                "level_params": [int(weight.numel()) if r is None else int(r * (rows_ + cols)) for r in ranks],
            }
        )
    return rows


def format_plan(levels: list[float], plan: list[dict[str, Any]]) -> str:
    """The plan as a Markdown table: a level's cell is ``full`` or ``r=<rank> (<params>)``."""
    cols = ["layer", "type", "weight shape", "full params"] + [f"g{i + 1} ({g:g})" for i, g in enumerate(levels)]
    factorized = sum(any(r is not None for r in row["ranks"]) for row in plan)
    lines = [
        f"FedHM plan: {len(plan)} layers selected by the rule (model.factorize), {factorized} of them "
        "factorized below gamma=1 (the others are the first rho, kept full rank)",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in plan:
        cells = [row["layer"], row["type"], "x".join(map(str, row["shape"])), f"{row['params']:,}"]
        cells += ["full" if r is None else f"r={r} ({p:,})" for r, p in zip(row["ranks"], row["level_params"])]
        lines.append("| " + " | ".join(cells) + " |")
    totals = [sum(row["level_params"][i] for row in plan) for i in range(len(levels))]
    lines.append(
        "| total | | | " + f"{sum(row['params'] for row in plan):,} | " + " | ".join(f"{t:,}" for t in totals) + " |"
    )
    return "\n".join(lines)


def size_warnings(opts: RunOptions, spec: dict[str, Any]) -> list[str]:
    """FedHM levels that do not shrink the model: one line per level below 1 whose model is not
    strictly smaller than the full one (e.g. a rule that selects only the stem), naming the
    ``model.factorize`` keys that change it. Counted from shapes (no weight, no SVD)."""
    if not isinstance(opts.method, FedHMOptions):
        return []
    gammas = list(opts.levels.ratios)
    full, *params = fedhm_level_params(spec, [1.0, *gammas], opts.method.rho)
    fix = "select more layers with model.factorize (include, exclude, types, pointwise, head, keep_first) or method.rho"
    small = [(g, p) for g, p in zip(gammas, params) if g < 1]
    if small and all(p >= full for _, p in small):
        return [
            f"FedHM factorizes no layer of this model at any level: every level is the full model "
            f"({full:,} parameters), so the run is FedAvg; {fix}"
        ]
    return [
        f"level {g:g} is not smaller than the full model ({p:,} >= {full:,} parameters); {fix}"
        for g, p in small
        if p >= full
    ]


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_table(opts: RunOptions, rows: list[dict[str, Any]]) -> str:
    m = opts.model
    model = f"{m.target} {dict(m.kwargs or {})}" if m.arch == "custom" else f"{m.arch} (width {m.width})"
    head = f"method {opts.method.name} | model {model} | dataset {opts.dataset.name}"
    extra = [k for k in rows[0] if k not in ("level", "ratio", "params", "macs", "payload_bytes", "of_full")]
    cols = ["level", "ratio", "parameters", "params (M)", "of full model", "MACs / input", "payload bytes"] + extra
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            r["level"],
            f"{r['ratio']:g}",
            f"{r['params']:,}",
            f"{r['params'] / 1e6:.2f}",
            f"{r['of_full']:.3f}" if "of_full" in r else "-",
            _human(r["macs"]) if "macs" in r else "-",
            _human(r["payload_bytes"]),
        ]
        cells += [f"{r[k]:,}" for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedhm_flwr.ops.tools.cost_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=resnet18 dataset=cifar10")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.overrides)
        opts, spec = run_options(cfg), model_spec(cfg)
        rows = table_rows(opts, spec)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else format_table(opts, rows))
    if not args.json:
        plan = plan_rows(opts, spec)
        if plan:
            print()
            print(format_plan([r["ratio"] for r in rows], plan))
    for line in size_warnings(opts, spec):
        print(f"warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
