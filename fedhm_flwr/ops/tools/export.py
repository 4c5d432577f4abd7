"""Deployable models from a run: one level's model as a device would run it.

``fedhm export run=DIR level=GAMMA [out=DIR]`` (``python -m fedhm_flwr.ops.tools.export ...``) reads the run's
checkpoint (``checkpoint/global_model.safetensors``, ``config.yaml``) and writes that level's
deployable model, as the strategy defines it (:meth:`Method.deployable`; FedHM: the SVD
truncation of the global model at the level's ranks, i.e. the factorized network, not the
recovered full one):

* ``model.safetensors``: the weights, with the model spec (JSON) in the metadata; rebuild with
  :func:`load_model`;
* ``model.pt2``: a ``torch.export`` program (batch size dynamic), ``torch.export.load(...).module()``;
* ``model.onnx``: one self-contained ONNX file, checked in ONNX Runtime one image at a time
  against the PyTorch model on the run's test set (:mod:`fedhm_flwr.ops.tools.onnx_model`): a file
  whose logits differ beyond the tolerance is refused and nothing is written;
* ``model_card.md`` / ``model_card.json``: parameters, MACs, the accuracy of the exported model
  (PyTorch, and ONNX Runtime one image at a time), the preprocessing with a snippet running the
  ONNX file on one image, the level's accuracy in the run (server's test set and/or the clients'
  federated figures, from ``summary.json``), the checkpoint round and the run's config.

Every file is written atomically, with the usual permissions (0666 less the umask).
"""

from __future__ import annotations

import io
import json
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig
from safetensors import safe_open
from safetensors.torch import load as load_safetensors, save as save_safetensors
from torch import nn

from fedhm_flwr.config import ConfigError, RunOptions, model_spec, resume_config, run_options, to_yaml
from fedhm_flwr.data import class_names, client_dataset, source_info, test_dataset
from fedhm_flwr.math.bn_stats import batch_statistics_layers, bn_sums, norm_layers
from fedhm_flwr.math.train import evaluate
from fedhm_flwr.models import build_model, count_macs, count_parameters, deployable_network, input_shape
from fedhm_flwr.ops.tools.model_card import model_card_markdown, run_accuracy, test_set_words
from fedhm_flwr.ops.tools.onnx_model import OnnxCheckFailed, check_onnx, missing_packages, onnx_bytes, ort_snippet
from fedhm_flwr.reporting.results import CONFIG_FILE, atomic_write, load_bn_statistics, load_checkpoint
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
    raise ConfigError(
        "level", text, f"one of the run's levels {[f'{x:g}' for x in levels]} (a number or a fraction such as 1/8)"
    )


def deployable_model(
    run_dir: Path, level: str | float
) -> tuple[DictConfig, RunOptions, float, dict[str, Any], nn.Module, dict[str, Any], dict[str, str]]:
    """(config, its parsed options, level, spec, model with the level's weights and fixed
    normalisation statistics, strategy state, which statistics) from a run's checkpoint. The model predicts in eval mode
    independently of the batch (:func:`fix_statistics`); it is built by the function the run's
    final deployable accuracy is scored with (:func:`fedhm_flwr.models.deployable_network`)."""
    cfg = resume_config(run_dir)
    opts = run_options(cfg)
    state, saved = load_checkpoint(run_dir)
    strategy = STRATEGIES[opts.method.name](opts, model_spec(cfg))
    strategy.restore(saved)
    index = parse_level(level, strategy.levels)
    spec, level_state = strategy.method.deployable(index, state)
    sums, statistics = fix_statistics(
        run_dir, opts, spec, level_state, strategy.levels[index], int(saved.get("round", 0))
    )
    spec, model = deployable_network(spec, level_state, sums)
    return cfg, opts, strategy.levels[index], spec, model, saved, statistics


def fix_statistics(
    run_dir: Path,
    opts: RunOptions,
    spec: dict[str, Any],
    state: dict[str, torch.Tensor],
    level: float,
    checkpoint_round: int,
) -> tuple[dict[str, torch.Tensor] | None, dict[str, str]]:
    """(the sBN sums to install as the fixed normalisation statistics of ``spec``'s static norm
    layers, so that it predicts in eval mode independently of the batch, or None when it needs
    none; which statistics, over which data):

    * the federated statistics saved at the end of the run (the clients' sBN sums over their
      training data, :class:`fedhm_flwr.server.deployment.DeploymentQuery`), when they belong to the
      checkpoint's round;
    * else a pass over the training set on this machine (a checkpoint written before the run
      ended, or ``evaluation.deploy_stats=false``); refused with the reason when there is none;
    * a model with running statistics keeps them (averaged over the clients as buffers);
    * a model without batch norm needs nothing.
    """
    _, model = deployable_network(spec, state)
    if not batch_statistics_layers(model):
        if norm_layers(model):
            return None, {
                "statistics": "running_averaged",
                "data": "running statistics tracked by the clients in training, averaged over the clients",
            }
        return None, {"statistics": "none", "data": "the model has no batch normalisation"}
    saved = load_bn_statistics(run_dir)
    prefix = f"level_{level:g}/"
    if saved is not None and saved[1].get("round") == str(checkpoint_round):
        sums = {k[len(prefix) :]: v for k, v in saved[0].items() if k.startswith(prefix)}
        if sums:
            cap = int(saved[1].get("examples_per_node", "0"))  # (absent from checkpoints saved before it: all)
            examples = f", at most {cap} examples each" if cap > 0 else ""
            return sums, {
                "statistics": "federated",
                "data": f"the training data of the {saved[1].get('nodes_asked', '?')} clients asked after "
                f"round {checkpoint_round}{examples} (sBN sums; no data left them)",
            }
    try:
        train = client_dataset({**opts.data_spec(1), "scheme": "iid", "holdout": 0.0}, 0, opts.dataset.data_dir)
    except (OSError, ValueError) as err:
        raise ConfigError(
            "run",
            str(run_dir),
            "a run whose last round saved its deployment statistics "
            f"(evaluation.deploy_stats=true), or its training data on this machine ({err})",
        ) from None
    return bn_sums(model, train, opts.evaluation.batch_size, torch.device("cpu")), {
        "statistics": "training_data",
        "data": f"the training set on the exporting machine ({len(train)} examples): the checkpoint of round "
        f"{checkpoint_round} holds no federated statistics",
    }


def load_model(path: str | Path) -> nn.Module:
    """A model exported as safetensors: built from the spec in its metadata, weights loaded (strict)."""
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata() or {}
        if SPEC_KEY not in metadata:
            raise ValueError(f"{path} holds no '{SPEC_KEY}' metadata (not a fedhm-flwr export)")
        state = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return _model(metadata[SPEC_KEY], state)


def _model(spec_json: str, state: dict[str, torch.Tensor]) -> nn.Module:
    model = build_model(json.loads(spec_json), spectral_init=False)
    model.load_state_dict(state, strict=True)
    return model.eval()


def example_input(spec: dict[str, Any], batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *input_shape(spec), generator=torch.Generator().manual_seed(0))


def export_level(run_dir: str | Path, level: str | float, out: str | Path | None = None) -> dict[str, Any]:
    """Write the level's deployable model and its card into ``out`` (default
    ``<run>/export/level_<level>``); returns the card (with the files written). Everything is
    built and checked first: :class:`OnnxCheckFailed` (ONNX Runtime disagrees with the PyTorch
    model beyond the tolerance) leaves nothing written."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError("run", str(run_dir), "a run directory holding config.yaml and checkpoint/")
    cfg, opts, level_value, spec, model, saved, statistics = deployable_model(run_dir, level)
    out_dir = Path(out).expanduser().resolve() if out else run_dir / "export" / f"level_{level_value:g}"
    blobs: dict[str, bytes] = {}  # file name -> content, written once every check has passed
    notes: list[str] = []

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {SPEC_KEY: json.dumps(spec), "fedhm.level": f"{level_value:g}", "fedhm.method": opts.method.name}
    blobs["model.safetensors"] = save_safetensors(tensors, metadata=metadata)
    exported = _model(metadata[SPEC_KEY], load_safetensors(blobs["model.safetensors"]))  # the file, read back

    image = "image_size" in spec
    test = _test_logits(opts, exported) if image else None
    onnx_check = None
    if image:
        program = None
        try:
            program = torch.export.export(
                model, (example_input(spec),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},)
            )
            buf = io.BytesIO()
            torch.export.save(program, buf)
            blobs["model.pt2"] = buf.getvalue()
        except Exception as err:  # noqa: BLE001 - the safetensors export stands on its own
            notes.append(f"torch.export failed: {type(err).__name__}: {err}"[:500])
        missing = missing_packages()
        if missing:
            notes.append(f"ONNX not written: {', '.join(missing)} not installed (`make setup` installs them)")
        else:
            try:
                blobs["model.onnx"] = onnx_bytes(program if program is not None else model, example_input(spec))
            except Exception as err:  # noqa: BLE001 - an operator without an ONNX translation: the rest stands
                notes.append(f"ONNX not written: the conversion failed: {type(err).__name__}: {err}"[:500])
        if "model.onnx" in blobs:
            if test is not None:
                onnx_check = check_onnx(
                    blobs["model.onnx"], test["images"], test["logits"], test["labels"], test["described"]
                )
            else:  # no test set here: the same comparison on seeded random inputs
                x = example_input(spec, 64)
                with torch.inference_mode():
                    onnx_check = check_onnx(
                        blobs["model.onnx"],
                        x,
                        exported(x),
                        None,
                        "64 random inputs (the run's test set is not on this machine)",
                    )
    else:
        notes.append("torch.export / ONNX not written: token-input models are exported as safetensors only")
    if image and test is None:
        notes.append("no test accuracy of the exported model: the run's test set is not on this machine")

    pre = preprocessing(opts, spec) if image else None
    card = {
        "method": opts.method.name,
        "model": opts.model.arch,
        "dataset": opts.dataset.name,
        "level": level_value,
        "checkpoint_round": int(saved.get("round", 0)),
        "parameters": count_parameters(model),
        "macs_per_input": count_macs(model, input_shape(spec)) if image else None,
        # the exported file itself on the run's test set, eval mode, fixed statistics (any batch size)
        "test_accuracy": None if test is None else test["accuracy"],
        "test_examples": None if test is None else len(test["labels"]),
        "test_set": None if test is None else test["described"],  # name, split and size
        # model.onnx in ONNX Runtime, one image at a time, against the PyTorch model (onnx_model.check_onnx)
        "onnx_runtime": onnx_check,
        "onnx_snippet": ort_snippet(cast("dict[str, Any]", pre)) if onnx_check else None,  # (checked: an image model)
        "normalisation": statistics,
        "preprocessing": pre,
        # the run's own figures: the server's test set (with the statistics its evaluation used,
        # summary's bn_stats) and/or the clients' federated evaluation (evaluation.where)
        **run_accuracy(run_dir, level_value),
        "factorized_layers": spec.get("ranks", {}),
        "model_spec": spec,
        "files": {
            kind: name
            for kind, name in (
                ("safetensors", "model.safetensors"),
                ("torch_export", "model.pt2"),
                ("onnx", "model.onnx"),
            )
            if name in blobs
        },
        "notes": notes,
        "run_dir": str(run_dir),
        "config": to_yaml(cfg),
    }
    blobs["model_card.json"] = json.dumps(card, indent=1).encode()
    blobs["model_card.md"] = model_card_markdown(card).encode()
    for name, data in blobs.items():  # atomically, mode 0666 less the umask
        atomic_write(out_dir / name, data)
    return {**card, "out_dir": str(out_dir)}


def _test_logits(opts: RunOptions, model: nn.Module, batch_size: int = 256) -> dict[str, Any] | None:
    """The run's test images, labels, the exported model's logits for them and its accuracy, or
    None when the test set is not on this machine."""
    try:
        test = test_dataset(opts.data_spec(), data_dir=opts.dataset.data_dir)
    except (OSError, ValueError):
        return None
    images, labels = test.images, test.labels
    with torch.inference_mode():
        logits = torch.cat([model(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])
    # the accuracy as the run's evaluation scores it (the summary's final_deployable_acc/level_<γ>)
    scored = evaluate(model, test, opts.evaluation.batch_size, torch.device("cpu"))
    spec = opts.data_spec()
    total = source_info(spec, opts.dataset.data_dir).num_test
    described = test_set_words(spec["name"], len(labels), total, spec["max_test_examples"], spec["seed"])
    return {
        "images": images,
        "labels": labels,
        "logits": logits,
        "accuracy": scored["accuracy"],
        "described": described,
    }


def preprocessing(opts: RunOptions, spec: dict[str, Any]) -> dict[str, Any]:
    """What a device does to a raw image before the model: size, channels, normalisation, classes."""
    info = source_info(opts.data_spec(), opts.dataset.data_dir)
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
        "class_names": class_names(opts.data_spec(), opts.dataset.data_dir),
    }


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


USAGE = (
    "usage: python -m fedhm_flwr.ops.tools.export run=DIR level=GAMMA [out=DIR]\n\n"
    "A level's deployable model from a run's checkpoint.\n"
)
HELP = """arguments (key=value):
  run=DIR      a run directory (config.yaml, checkpoint/)
  level=GAMMA  one of the run's levels, a number or a fraction: 1, 0.5, 1/8
  out=DIR      where the files go (default: DIR/export/level_GAMMA)

writes model.safetensors (the model spec in its metadata), model.pt2 (torch.export),
model.onnx (checked in ONNX Runtime one image at a time against the PyTorch model on the
run's test set; refused, and nothing written, when they disagree) and model_card.md/.json
(sizes, accuracies, the preprocessing and how to run model.onnx on one image)."""


def main(argv: list[str] | None = None) -> int:
    """``python -m fedhm_flwr.ops.tools.export`` (``argv`` None) and ``fedhm export`` (a list: the
    command's own help has printed the usage line and examples, so ``--help`` adds the rest)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(args):
        print(
            (USAGE + "\n" if argv is None else "")
            + HELP
            + (
                "\nexample:\n  python -m fedhm_flwr.ops.tools.export run=/tmp/fedhm/r1 level=1/4"
                if argv is None
                else ""
            )
        )
        return 0
    try:
        pairs = parse_pairs(args)
        card = export_level(pairs["run"], pairs["level"], pairs.get("out"))
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OnnxCheckFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    ort = card["onnx_runtime"]

    def acc(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    print(
        f"level {card['level']:g}: {card['parameters']:,} parameters; wrote {', '.join(card['files'].values())} "
        f"and model_card.md/.json to {card['out_dir']}"
    )
    print(
        f"  exported model on the test set: {acc(card['test_accuracy'])} (PyTorch)"
        + (
            ""
            if not ort
            else f", {acc(ort['accuracy'])} (ONNX Runtime, one image at a time; max logit difference "
            f"{ort['max_abs_logit_difference']:.2g}, "
            f"predictions agree on {ort['predictions_agreeing']}/{ort['examples']})"
        )
    )
    print(
        f"  this level in the run: {acc(card['final_accuracy'])} (server's test set), "
        f"{acc(card['final_fed_accuracy'])} (its clients, federated)"
    )
    for note in card["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
