"""Deployable models from a run: one level's model as a device would run it.

``fedhm export run=DIR level=GAMMA [out=DIR]`` (``python -m fedhm_flwr.ops.export ...``) reads the run's
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
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fedhm_flwr.config import ConfigError, data_spec, model_spec, resume_config, to_yaml
from fedhm_flwr.core.protocol import NUM_EXAMPLES
from fedhm_flwr.data import class_names, client_dataset, source_info, test_dataset
from fedhm_flwr.math.bn_stats import apply_bn_statistics, batch_statistics_layers, bn_sums, norm_layers
from fedhm_flwr.math.train import evaluate
from fedhm_flwr.models import build_model, count_macs, count_parameters, input_shape
from fedhm_flwr.models.adapters import load_federated
from fedhm_flwr.reporting.results import CONFIG_FILE, SUMMARY_FILE, load_bn_statistics, load_checkpoint
from fedhm_flwr.server.registry import STRATEGIES

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


def deployable_model(run_dir: Path, level: str | float) -> tuple[Any, float, dict[str, Any], nn.Module, dict[str, Any], dict[str, str]]:
    """(config, level, spec, model with the level's weights and fixed normalisation statistics,
    strategy state, which statistics) from a run's checkpoint. The model predicts in eval mode
    independently of the batch (:func:`fix_statistics`)."""
    cfg = resume_config(run_dir)
    state, saved = load_checkpoint(run_dir)
    strategy = STRATEGIES[cfg.method.name](cfg, model_spec(cfg))
    strategy.restore(saved)
    index = parse_level(level, strategy.levels)
    spec, level_state = strategy.deployable(index, state)
    model = build_model(spec, spectral_init=False)
    if spec.get("trainable_only"):  # a frozen local backbone + the federated tensors
        load_federated(model, level_state)
    else:
        model.load_state_dict(level_state, strict=True)
    statistics = fix_statistics(run_dir, cfg, model, strategy.levels[index], int(saved.get("round", 0)))
    if statistics["statistics"] in ("federated", "training_data"):
        spec = {**spec, "bn_fixed": True}  # the statistics are buffers of the exported state dict
    return cfg, strategy.levels[index], spec, model.eval(), saved, statistics


def fix_statistics(run_dir: Path, cfg: Any, model: nn.Module, level: float, checkpoint_round: int) -> dict[str, str]:
    """Install fixed normalisation statistics in ``model``'s static norm layers, so that it
    predicts in eval mode independently of the batch; returns which statistics, over which data.

    * the federated statistics saved at the end of the run (the clients' sBN sums over their
      training data, :func:`fedhm_flwr.server.deployment.deployment_statistics`), when they belong to the
      checkpoint's round;
    * else a pass over the training set on this machine (a checkpoint written before the run
      ended, or ``evaluation.deploy_stats=false``); refused with the reason when there is none;
    * a model with running statistics keeps them (averaged over the clients as buffers);
    * a model without batch norm needs nothing.
    """
    layers = batch_statistics_layers(model)
    if not layers:
        if norm_layers(model):
            return {"statistics": "running_averaged",
                    "data": "running statistics tracked by the clients in training, averaged over the clients"}
        return {"statistics": "none", "data": "the model has no batch normalisation"}
    saved = load_bn_statistics(run_dir)
    prefix = f"level_{level:g}/"
    if saved is not None and saved[1].get("round") == str(checkpoint_round):
        sums = {k[len(prefix):]: v for k, v in saved[0].items() if k.startswith(prefix)}
        if sums:
            apply_bn_statistics(model, sums)
            return {"statistics": "federated",
                    "data": f"the training data of the {saved[1].get('nodes_asked', '?')} clients asked after round "
                            f"{checkpoint_round} (sBN sums; no data left them)"}
    try:
        train = client_dataset({**data_spec(cfg, 1), "scheme": "iid", "holdout": 0.0}, 0, cfg.dataset.get("data_dir"))
    except (OSError, ValueError) as err:
        raise ConfigError("run", str(run_dir), "a run whose last round saved its deployment statistics "
                          f"(evaluation.deploy_stats=true), or its training data on this machine ({err})") from None
    apply_bn_statistics(model, bn_sums(model, train, int(cfg.evaluation.batch_size), torch.device("cpu")))
    return {"statistics": "training_data",
            "data": f"the training set on the exporting machine ({len(train)} examples): the checkpoint of round "
                    f"{checkpoint_round} holds no federated statistics"}


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
    cfg, level_value, spec, model, saved, statistics = deployable_model(run_dir, level)
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
    test = exported_test_accuracy(cfg, out_dir / "model.safetensors") if image else None
    if image and test is None:
        notes.append("no test accuracy of the exported model: the run's test set is not on this machine")
    card = {
        "method": cfg.method.name,
        "model": cfg.model.arch,
        "dataset": cfg.dataset.name,
        "level": level_value,
        "checkpoint_round": int(saved.get("round", 0)),
        "parameters": count_parameters(model),
        "macs_per_input": count_macs(model, input_shape(spec)) if image else None,
        # the exported file itself on the run's test set, eval mode, fixed statistics (any batch size)
        "test_accuracy": None if test is None else test["accuracy"],
        "test_examples": None if test is None else test[NUM_EXAMPLES],
        "normalisation": statistics,
        "preprocessing": preprocessing(cfg, spec) if image else None,
        # the run's own figures, with the statistics its evaluation used (summary's bn_stats)
        "final_accuracy": summary.get(f"final_acc/level_{level_value:g}"),
        "best_accuracy": summary.get(f"best_acc/level_{level_value:g}"),
        "run_bn_stats": summary.get("bn_stats"),
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


def exported_test_accuracy(cfg: Any, path: Path, batch_size: int = 256) -> dict[str, float] | None:
    """Accuracy of the exported file (rebuilt by :func:`load_model`) on the run's test set, or None
    when the test set is not on this machine."""
    try:
        test = test_dataset(data_spec(cfg), data_dir=cfg.dataset.get("data_dir"))
    except (OSError, ValueError):
        return None
    return evaluate(load_model(path), test, batch_size, torch.device("cpu"))


def preprocessing(cfg: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """What a device does to a raw image before the model: size, channels, normalisation, classes."""
    info = source_info(data_spec(cfg), cfg.dataset.get("data_dir"))
    channels = int(spec["in_channels"])
    return {
        "image_size": int(spec["image_size"]),
        "channels": channels,
        "color": "L (grayscale)" if channels == 1 else "RGB",
        "resize": f"scale to cover {spec['image_size']}x{spec['image_size']}, centre-crop (PIL.ImageOps.fit, bilinear)",
        "scale": "pixel / 255",
        "mean": list(info.mean),
        "std": list(info.std),
        "layout": "NCHW float32, (x / 255 - mean) / std per channel",
        "class_names": class_names(data_spec(cfg), cfg.dataset.get("data_dir")),
    }


def _export_onnx(model: nn.Module, spec: dict[str, Any], path: Path) -> bool:
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
        f"| accuracy of this exported model on the test set | {pct(card['test_accuracy'])} "
        f"({card['test_examples'] or 0:,} images, any batch size) |",
        f"| normalisation statistics | {card['normalisation']['statistics']}: {card['normalisation']['data']} |",
        f"| final accuracy of this level in the run | {pct(card['final_accuracy'])} (statistics: {card['run_bn_stats']}) |",
        f"| best accuracy of this level in the run | {pct(card['best_accuracy'])} |",
        f"| factorized layers (rank) | {len(card['factorized_layers'])} |",
        "", "Files: " + ", ".join(f"`{f}`" for f in card["files"].values()), "",
    ]
    pre = card.get("preprocessing")
    if pre:
        lines += ["## Input", "",
                  f"{pre['color']} images, {pre['resize']}, {pre['scale']}, normalised with mean {pre['mean']} and "
                  f"std {pre['std']} ({pre['layout']}). The model is in eval mode with fixed statistics: "
                  "one image at a time gives the same prediction as a batch.", ""]
        if pre["class_names"]:
            lines += ["Classes (output index order): " + ", ".join(f"{i}: {c}" for i, c in enumerate(pre["class_names"])), ""]
    lines += [
        "Load: `fedhm_flwr.ops.export.load_model('model.safetensors')` (the spec is in the file's metadata) "
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
