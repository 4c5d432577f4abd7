"""Deployable models from a run: one level's model as a device would run it.

``fedhm export run=DIR level=GAMMA [out=DIR]`` (``python -m fedhm_flwr.export ...``) reads the run's
checkpoint (``checkpoint/global_model.safetensors``, ``config.yaml``) and writes that level's
deployable model, as the strategy defines it (:meth:`HeteroStrategy.deployable`; FedHM: the SVD
truncation of the global model at the level's ranks, i.e. the factorized network, not the
recovered full one):

* ``model.safetensors``: the weights, with the model spec (JSON) in the metadata; rebuild with
  :func:`load_model`;
* ``model.pt2``: a ``torch.export`` program (batch size dynamic), ``torch.export.load(...).module()``;
* ``model.onnx`` where an ONNX exporter (``onnx``/``onnxscript``) is installed;
* ``model_card.md`` / ``model_card.json``: parameters, MACs, the level's accuracy in that run
  (from ``summary.json``), the checkpoint round and the run's config.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fedhm_flwr.config import ConfigError, resume_config, to_yaml
from fedhm_flwr.models import build_model, count_macs, count_parameters, input_shape
from fedhm_flwr.results import CONFIG_FILE, SUMMARY_FILE, load_checkpoint

SPEC_KEY = "fedhm.model_spec"
EXPORT_KEYS = ("run", "level", "out")


def parse_level(text: str | float, levels: list[float]) -> int:
    """The index of ``text`` (``0.125``, ``1/8``) among the run's levels; ConfigError otherwise."""
    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        value = None
    for index, level in enumerate(levels):
        if value is not None and abs(level - value) < 1e-9:
            return index
    raise ConfigError("level", text, f"one of the run's levels {[f'{x:g}' for x in levels]} (a number or a fraction such as 1/8)")


def deployable_model(run_dir: Path, level: str | float) -> tuple[Any, float, dict[str, Any], nn.Module, dict[str, Any]]:
    """(config, level, spec, model with the level's weights, strategy state) from a run's checkpoint."""
    from strategies import STRATEGIES
    from fedhm_flwr.config import model_spec

    cfg = resume_config(run_dir)
    state, saved = load_checkpoint(run_dir)
    strategy = STRATEGIES[cfg.method.name](cfg, model_spec(cfg))
    strategy.restore(saved)
    index = parse_level(level, strategy.levels)
    spec, level_state = strategy.deployable(index, state)
    model = build_model(spec, spectral_init=False)
    if spec.get("trainable_only"):  # a frozen local backbone + the federated tensors
        from fedhm_flwr.models.adapters import load_federated

        load_federated(model, level_state)
    else:
        model.load_state_dict(level_state, strict=True)
    return cfg, strategy.levels[index], spec, model.eval(), saved


def load_model(path: str | Path) -> nn.Module:
    """A model exported as safetensors: built from the spec in its metadata, weights loaded (strict)."""
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata() or {}
        if SPEC_KEY not in metadata:
            raise ValueError(f"{path} holds no '{SPEC_KEY}' metadata (not a fedhm-flwr export)")
        state = {k: fh.get_tensor(k) for k in fh.keys()}
    model = build_model(json.loads(metadata[SPEC_KEY]), spectral_init=False)
    model.load_state_dict(state, strict=True)
    return model.eval()


def example_input(spec: dict[str, Any], batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *input_shape(spec), generator=torch.Generator().manual_seed(0))


def export_level(run_dir: str | Path, level: str | float, out: str | Path | None = None) -> dict[str, Any]:
    """Write the level's deployable model and its card into ``out`` (default
    ``<run>/export/level_<level>``); returns the card (with the files written)."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError("run", str(run_dir), "a run directory holding config.yaml and checkpoint/")
    cfg, level_value, spec, model, saved = deployable_model(run_dir, level)
    out_dir = Path(out).expanduser().resolve() if out else run_dir / "export" / f"level_{level_value:g}"
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    notes: list[str] = []

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"),
              metadata={SPEC_KEY: json.dumps(spec), "fedhm.level": f"{level_value:g}", "fedhm.method": cfg.method.name})
    files["safetensors"] = "model.safetensors"

    image = "image_size" in spec
    if image:
        try:
            batch = torch.export.Dim("batch", min=1, max=4096)
            program = torch.export.export(model, (example_input(spec),), dynamic_shapes=({0: batch},))
            torch.export.save(program, str(out_dir / "model.pt2"))
            files["torch_export"] = "model.pt2"
        except Exception as err:  # noqa: BLE001 - the safetensors export stands on its own
            notes.append(f"torch.export failed: {type(err).__name__}: {err}"[:500])
        onnx = _export_onnx(model, spec, out_dir / "model.onnx")
        if onnx:
            files["onnx"] = "model.onnx"
        else:
            notes.append("ONNX not written: no ONNX exporter (packages onnx, onnxscript) installed")
    else:
        notes.append("torch.export / ONNX not written: token-input models are exported as safetensors only")

    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    card = {
        "method": cfg.method.name,
        "model": cfg.model.arch,
        "dataset": cfg.dataset.name,
        "level": level_value,
        "checkpoint_round": int(saved.get("round", 0)),
        "parameters": count_parameters(model),
        "macs_per_input": count_macs(model, input_shape(spec)) if image else None,
        "final_accuracy": summary.get(f"final_acc/level_{level_value:g}"),
        "best_accuracy": summary.get(f"best_acc/level_{level_value:g}"),
        "rounds_completed": summary.get("rounds_completed"),
        "factorized_layers": spec.get("ranks", {}),
        "model_spec": spec,
        "files": files,
        "notes": notes,
        "run_dir": str(run_dir),
        "config": to_yaml(cfg),
    }
    (out_dir / "model_card.json").write_text(json.dumps(card, indent=1))
    (out_dir / "model_card.md").write_text(model_card_markdown(card))
    return {**card, "out_dir": str(out_dir)}


def _export_onnx(model: nn.Module, spec: dict[str, Any], path: Path) -> bool:
    from importlib.util import find_spec

    if find_spec("onnx") is None or find_spec("onnxscript") is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example_input(spec),), str(path), input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    return True


def model_card_markdown(card: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "not recorded" if x is None else f"{x:.4f}"

    macs = card["macs_per_input"]
    lines = [
        f"# {card['method']} · {card['model']} · {card['dataset']} · level {card['level']:g}", "",
        f"The deployable model of level {card['level']:g} from the run in `{card['run_dir']}` "
        f"(checkpoint of round {card['checkpoint_round']}).", "",
        "| | |", "|---|---|",
        f"| parameters | {card['parameters']:,} |",
        f"| MACs per input | {'-' if macs is None else f'{macs:,}'} |",
        f"| final accuracy of this level in the run | {pct(card['final_accuracy'])} |",
        f"| best accuracy of this level in the run | {pct(card['best_accuracy'])} |",
        f"| factorized layers (rank) | {len(card['factorized_layers'])} |",
        "", "Files: " + ", ".join(f"`{f}`" for f in card["files"].values()), "",
        "Load: `fedhm_flwr.export.load_model('model.safetensors')` (the spec is in the file's metadata) "
        "or `torch.export.load('model.pt2').module()`.", "",
    ]
    lines += [f"Note: {n}" for n in card["notes"]]
    lines += ["", "## Config", "", "```yaml", card["config"].rstrip(), "```", ""]
    return "\n".join(lines)


def parse_pairs(argv: list[str]) -> dict[str, str]:
    """``run=DIR level=0.125 out=DIR`` -> dict; one ConfigError naming a bad or missing key."""
    pairs: dict[str, str] = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in EXPORT_KEYS:
            raise ConfigError(key if sep else item, value, f"key=value pairs with keys {list(EXPORT_KEYS)}")
        pairs[key] = value
    for key in ("run", "level"):
        if not pairs.get(key):
            raise ConfigError(key, None, "required: fedhm export run=<run dir> level=<one of its levels> [out=<dir>]")
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedhm export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  fedhm export run=/tmp/fedhm/r1 level=1/4")
    parser.add_argument("pairs", nargs="*", help="run=<run dir> level=<gamma> [out=<dir>]")
    args = parser.parse_args(argv)
    try:
        pairs = parse_pairs(args.pairs)
        card = export_level(pairs["run"], pairs["level"], pairs.get("out"))
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"level {card['level']:g}: {card['parameters']:,} parameters, final accuracy "
          f"{card['final_accuracy']}; wrote {', '.join(card['files'].values())} and model_card.md/.json to {card['out_dir']}")
    for note in card["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
