"""Models built from a JSON-able spec dict (the only way server and clients build models).

Spec keys: ``arch`` (a key of :data:`ARCHS`), ``num_classes``, ``in_channels``, ``image_size``,
optional ``width`` (base width, default 64) and optional ``ranks`` (``{layer name: rank}``; when
non-empty the named layers are factorized, giving the hybrid model whose state dict keys match
:func:`fedhm_flwr.lowrank.factorize_state`). Other keys are passed to the builder untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from ..lowrank import factorize_modules
from .cnn import CNN, build_cnn
from .costs import count_macs, count_parameters
from .resnet import ResNet, build_resnet18, build_resnet34, resnet18, resnet34
from .transformer import build_minilm, build_vit

__all__ = [
    "ARCHS",
    "CNN",
    "ResNet",
    "build_model",
    "count_macs",
    "count_parameters",
    "input_shape",
    "resnet18",
    "resnet34",
]

#: ``arch`` name -> builder taking the spec and returning the full-rank model.
ARCHS: dict[str, Callable[[Mapping], nn.Module]] = {
    "cnn": build_cnn,
    "resnet18": build_resnet18,
    "resnet34": build_resnet34,
    "minilm": build_minilm,  # transformer track: MiniLM text classifier (LoRA / DeMA / full)
    "vit": build_vit,  # transformer track: small ViT for 28x28 images
}

_REQUIRED = ("arch", "num_classes", "in_channels", "image_size")
_REQUIRED_BY_ARCH = {"minilm": ("arch", "num_classes")}  # token inputs: no image shape


def input_shape(spec: Mapping) -> tuple[int, int, int]:
    """``(in_channels, image_size, image_size)`` of one input (e.g. for :func:`count_macs`)."""
    return (int(spec["in_channels"]), int(spec["image_size"]), int(spec["image_size"]))


def build_model(spec: Mapping, *, spectral_init: bool = True) -> nn.Module:
    """Build the model described by ``spec`` (see the module docstring).

    With a non-empty ``spec["ranks"]`` the full model is built and then factorized in place
    (:func:`fedhm_flwr.lowrank.factorize_modules`), spectrally initialised from its random
    weights. ``spectral_init=False`` skips those SVDs (seconds on a CPU for a ResNet); use it
    whenever a state dict is loaded right after building.
    """
    missing = [key for key in _REQUIRED_BY_ARCH.get(spec.get("arch"), _REQUIRED) if key not in spec]
    if missing:
        raise ValueError(f"model spec lacks {missing}")
    arch = spec["arch"]
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; allowed: {sorted(ARCHS)}")
    model = ARCHS[arch](spec)
    ranks = spec.get("ranks") or {}
    if ranks:
        factorize_modules(model, {str(k): int(v) for k, v in ranks.items()}, spectral_init=spectral_init)
    prism_layers = spec.get("prism") or {}  # PriSM: {layer: {"rank": r, "rows": [...]}} -> sampled sub-layers
    if prism_layers:
        from ..prism import prismify_modules  # uninitialised; the sub-model's state is loaded right after

        prismify_modules(model, prism_layers)
    return model
