"""Models built from a JSON-able spec dict (the only way server and clients build models).

Spec keys: ``arch`` (a key of :data:`ARCHS`), ``num_classes``, ``in_channels``, ``image_size``,
optional ``width`` (base width, default 64). ``arch: custom`` builds a user's model instead:
``target`` (``"package.module:factory"``) called with ``kwargs`` (see :func:`build_custom`).

A model at a level is the arch's model with the spec's *level transforms* applied, in the order of
:data:`LEVEL_TRANSFORMS` (each one acts only when its spec keys are present; user models go through
the same ones):

* ``width`` (``width_rate``, ``scaler``): HeteroFL / FedRolex width slicing, which the built-in
  CNN and ResNets do in their constructors; any other model refuses it;
* ``adapt`` (``train_backbone``, ``lora``, ``dema``): the transformer track's frozen backbone,
  LoRA, DeMA adapters or full fine-tuning (:func:`fedhm_flwr.models.transformer.adapt`);
* ``factorize`` (a rule, :mod:`fedhm_flwr.models.rules`): which layers FedHM may factorize;
* ``static_bn`` (true): every BatchNorm with running statistics becomes static BN (batch
  statistics always, as the papers use);
* ``ranks`` (``{layer name: rank}``; when non-empty the named layers are factorized, giving the
  hybrid model whose state dict keys match :func:`fedhm_flwr.math.lowrank.factorize_state`);
* ``prism`` (``{layer: {"rank": r, "rows": [...]}}``): PriSM's sampled sub-layers;
* ``bn_fixed`` (true): every static norm layer gets running-statistics buffers that eval mode
  uses: a deployable model whose fixed statistics are in its state dict (``fedhm export``).

Other keys are passed to the builder untouched.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from fedhm_flwr.math.bn_stats import apply_bn_statistics, fixed_bn

from .adapters import load_federated
from .cnn import CNN, build_cnn
from .costs import count_macs, count_parameters
from .custom import build_custom, resolve_target
from .layers import factorize_modules, prismify_modules
from .resnet import ResNet, build_resnet18, build_resnet34, resnet18, resnet34
from .rules import FactorizeRule, model_rule
from .text import MiniLMClassifier
from .transformer import adapt, minilm, vit
from .vit import ViT

__all__ = [
    "ARCHS",
    "CNN",
    "LEVEL_TRANSFORMS",
    "ResNet",
    "build_custom",
    "build_model",
    "count_macs",
    "count_parameters",
    "deployable_network",
    "input_shape",
    "resnet18",
    "resnet34",
    "resolve_target",
    "shape_device",
    "static_bn",
]


#: ``arch`` name -> builder taking the spec and returning the full-rank model.
ARCHS: dict[str, Callable[[Mapping[str, Any]], nn.Module]] = {
    "cnn": build_cnn,
    "resnet18": build_resnet18,
    "resnet34": build_resnet34,
    "minilm": minilm,  # transformer track: MiniLM text classifier (LoRA / DeMA / full)
    "vit": vit,  # transformer track: small ViT for 28x28 images (and FedHM)
    "custom": build_custom,  # a user's model: spec["target"](**spec["kwargs"])
}
#: Archs whose builders slice widths (``width_rate``, ``scaler``) in their constructors.
WIDTH_ARCHS = ("cnn", "resnet18", "resnet34")
TRANSFORMER_ARCHS = ("minilm", "vit")

_REQUIRED = ("arch", "num_classes", "in_channels", "image_size")
#: token inputs and user models: no image shape
_REQUIRED_BY_ARCH: dict[str | None, tuple[str, ...]] = {"minilm": ("arch", "num_classes"), "custom": ("arch", "target")}


def input_shape(spec: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(in_channels, image_size, image_size)`` of one input (e.g. for :func:`count_macs`)."""
    return (int(spec["in_channels"]), int(spec["image_size"]), int(spec["image_size"]))


def static_bn(model: nn.Module) -> nn.Module:
    """Replace, in place, every BatchNorm with running statistics by static BN (sBN:
    ``track_running_stats=False``, batch statistics in training and evaluation), keeping its
    affine weights. Their running-statistics buffers leave the state dict. Returns ``model``.

    Which statistics evaluation normalises with (``model.static_bn`` x ``evaluation.bn_stats``):

    * running statistics kept (``static_bn: false``, the default; torchvision's models): the
      buffers ``running_mean``/``running_var``/``num_batches_tracked`` travel with the weights and
      are averaged like them (weighted mean; the counter rounded down). In evaluation the model
      normalises with these averaged running statistics (with ``bn_stats=test_batch`` too: eval
      mode reads the buffers), and every level's deployable model with the full model's, since a
      truncation keeps the buffers; ``bn_stats=federated`` replaces them by the statistics the
      clients sum over their training data for the model evaluated.
    * ``static_bn: true`` (the papers' sBN, and what the built-in models always use): no running
      statistics; ``bn_stats=test_batch`` normalises with each test batch's statistics,
      ``bn_stats=federated`` with the clients' summed training statistics of the model evaluated.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            new = type(module)(
                module.num_features,
                eps=module.eps,
                momentum=module.momentum,
                affine=module.affine,
                track_running_stats=False,
            )
            if module.affine:
                new.load_state_dict({"weight": module.weight, "bias": module.bias})
            new.to(device=module.weight.device if module.affine else None)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def _width(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    sliced = float(spec.get("width_rate", 1.0)) != 1.0 or bool(spec.get("scaler", False))
    if sliced and spec["arch"] not in WIDTH_ARCHS:
        raise ValueError(
            f"model spec: width slicing (width_rate, scaler) needs a model built by width: "
            f"arch one of {list(WIDTH_ARCHS)}, got {spec['arch']!r}"
        )
    return model  # the width archs' builders took width_rate / scaler as constructor arguments


def _adapt(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    if spec["arch"] in TRANSFORMER_ARCHS:  # (their builders give these classes)
        return adapt(cast("MiniLMClassifier | ViT", model), spec)
    keys = [k for k in ("train_backbone", "lora", "dema") if spec.get(k) is not None]
    if keys:
        raise ValueError(f"model spec: {keys} need a transformer, arch one of {list(TRANSFORMER_ARCHS)}")
    return model


def _factorize_rule(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    """``factorize``: the model's rule with the spec's entries on top. A rule that factorizes the
    head (``head: true``) also ends the per-class averaging of the head's rows (their factors
    mix classes): the model then names no classifier."""
    if spec.get("factorize"):
        rule = FactorizeRule.from_mapping(spec["factorize"], base=model_rule(model))
        model.factorize_rule = rule  # type: ignore[assignment]  # a plain attribute (torch types tensors, modules)
        if rule.head:
            model.classifier_name = ""  # type: ignore[assignment]  # (as above)
    return model


def _static_bn(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    return static_bn(model) if spec.get("static_bn") else model


def _ranks(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    ranks = spec.get("ranks") or {}
    if ranks:
        factorize_modules(model, {str(k): int(v) for k, v in ranks.items()}, spectral_init=spectral_init)
    return model


def _prism(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    layers = spec.get("prism") or {}  # PriSM: {layer: {"rank": r, "rows": [...]}} -> sampled sub-layers
    if layers:
        prismify_modules(model, layers)  # uninitialised; the sub-model's state is loaded right after
    return model


def _bn_fixed(model: nn.Module, spec: Mapping[str, Any], spectral_init: bool) -> nn.Module:
    return fixed_bn(model) if spec.get("bn_fixed") else model


#: The level transforms, applied in this order by :func:`build_model`: name -> transform(model,
#: spec, spectral_init) returning the model (each acts only when its spec keys are present).
LEVEL_TRANSFORMS: dict[str, Callable[[nn.Module, Mapping[str, Any], bool], nn.Module]] = {
    "width": _width,
    "adapt": _adapt,
    "factorize": _factorize_rule,
    "static_bn": _static_bn,
    "ranks": _ranks,
    "prism": _prism,
    "bn_fixed": _bn_fixed,
}


def build_model(spec: Mapping[str, Any], *, spectral_init: bool = True) -> nn.Module:
    """Build the model described by ``spec`` (see the module docstring).

    The arch's builder gives the full model; then every level transform of
    :data:`LEVEL_TRANSFORMS` runs. With a non-empty ``spec["ranks"]`` the named layers are
    factorized in place (:func:`fedhm_flwr.models.layers.factorize_modules`), spectrally initialised
    from the model's random weights. ``spectral_init=False`` skips those SVDs (seconds on a CPU
    for a ResNet); use it whenever a state dict is loaded right after building.
    """
    missing = [key for key in _REQUIRED_BY_ARCH.get(spec.get("arch"), _REQUIRED) if key not in spec]
    if missing:
        raise ValueError(f"model spec lacks {missing}")
    arch = spec["arch"]
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; allowed: {sorted(ARCHS)}")
    model = ARCHS[arch](spec)
    for transform in LEVEL_TRANSFORMS.values():
        model = transform(model, spec, spectral_init)
    return model


def deployable_network(
    spec: Mapping[str, Any], state: Mapping[str, torch.Tensor], sums: Mapping[str, torch.Tensor] | None = None
) -> tuple[dict[str, Any], nn.Module]:
    """(spec, model) of the network a device runs: ``spec``'s model with ``state`` loaded (a
    frozen-backbone model: its federated tensors over the local backbone), ``sums`` (sBN sums,
    :mod:`fedhm_flwr.math.bn_stats`) installed as its fixed norm statistics when given (the spec
    then says ``bn_fixed``), in eval mode. The one place both the server's evaluation (the run's
    final deployable accuracy) and ``fedhm export`` build a model to score or ship."""
    model = build_model(spec, spectral_init=False)
    if spec.get("trainable_only"):
        load_federated(model, state)
    else:
        model.load_state_dict(state, strict=True)
    if sums is not None:
        apply_bn_statistics(model, sums)
        spec = {**spec, "bn_fixed": True}
    return dict(spec), model.eval()


#: a model with at most this many parameters is counted on the CPU (built and run on a batch of 2 in
#: milliseconds); a larger one on the meta device, where every operation runs through torch's Python
#: decompositions, which import ``torch._dynamo`` at their first call (about 2 s of CPU, once per process)
SHAPES_ON_CPU_UP_TO = 2_000_000


@functools.lru_cache(maxsize=64)
def _shape_device(spec_json: str, small_on_cpu: bool) -> str:
    spec = json.loads(spec_json)
    try:
        with torch.device("meta"):
            model = build_model(spec, spectral_init=False)
            if small_on_cpu and sum(p.numel() for p in model.parameters()) <= SHAPES_ON_CPU_UP_TO:
                return "cpu"
            if "image_size" in spec:
                model(torch.empty(2, *input_shape(spec)))
    except Exception:  # noqa: BLE001 - any failure means "not on the meta device"
        return "cpu"
    return "meta"


@contextlib.contextmanager
def shape_device(spec: Mapping[str, Any], *, small_on_cpu: bool = True) -> Iterator[torch.device]:
    """Where to build ``spec``'s model when only shapes matter (counting parameters and MACs, the
    config check), as a context: the CPU for a small model (:data:`SHAPES_ON_CPU_UP_TO`; not with
    ``small_on_cpu=False``, for work that the meta device skips whatever the size: a method's payloads,
    FedHM's SVDs) or one whose constructor or forward the meta device cannot run (e.g. torchvision's
    RegNet), else the meta device (no weight allocated). Decided once per spec (a meta build, and a meta
    forward of batch 2). On the CPU, the random draws of the weights' initialisation are undone on
    leaving (torch's global generator is as it was), as the meta device draws none: counting leaves a
    seeded run as it is."""
    plain = {k: v for k, v in spec.items() if k not in ("ranks", "prism")}  # the architecture decides
    device = torch.device(_shape_device(json.dumps(plain, sort_keys=True, default=str), small_on_cpu))
    with torch.random.fork_rng(devices=[]) if device.type == "cpu" else contextlib.nullcontext(), device:
        yield device
