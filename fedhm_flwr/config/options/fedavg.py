"""The options of homogeneous FedAvg, the baseline run on FedHM's or HeteroFL's models
(docs/METHODS.md)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from omegaconf import DictConfig
from pydantic.dataclasses import dataclass

from fedhm_flwr.config.options.base import (
    BY_WIDTH,
    CONV_ARCHS,
    ELEMENTWISE_MODES,
    MethodOptions,
    Rho,
    frobenius_decay,
    grad_clip,
    rho,
)
from fedhm_flwr.config.options.declare import DECLARED, Flag, Num, OneOf, Text, option
from fedhm_flwr.config.options.sections import ROBUST


@dataclass(frozen=True, config=DECLARED)
class FedAvgOptions(MethodOptions):
    """Homogeneous FedAvg: the full model, or the smallest level of FedHM or HeteroFL; with
    ``method.family=heterofl`` it runs on HeteroFL's models (pair key ``fedavg/heterofl``)."""

    name = "fedavg"
    models = (*CONV_ARCHS, "vit", "custom")
    needs = "an image classifier (cnn, resnet18, resnet34, vit, or a model.target)"
    heterofl_models = CONV_ARCHS
    heterofl_needs = BY_WIDTH + "method.family=heterofl slices widths"
    presets: ClassVar[dict[str, dict[str, Any]]] = {"fedavg_smallest": {"variant": "smallest"}}

    variant: Annotated[Text, OneOf(("full", "smallest"))] = option(
        "full", "full: the full model (upper bound) | smallest: the smallest level's model"
    )
    family: Annotated[Text, OneOf(("fedhm", "heterofl"))] = option(
        "fedhm", "whose smallest level: fedhm (low-rank model at min levels.ratios) | heterofl (width sub-model)"
    )
    rho: Rho = rho(None)
    frobenius_decay: Flag = frobenius_decay(True)
    scaler: Flag = option(True, "family heterofl: Scaler, activations / rate before each norm, in training only")
    grad_clip: Num = grad_clip(1.0)

    def clips(self) -> float | None:
        return self.grad_clip if self.family == "heterofl" else None  # family fedhm: train.grad_clip

    def robust_modes(self) -> tuple[str, ...]:
        return ROBUST if self.variant == "full" or self.family == "fedhm" else ELEMENTWISE_MODES

    @classmethod
    def pairs(cls) -> dict[str, tuple[tuple[str, ...], str]]:
        return {**super().pairs(), "fedavg/heterofl": (cls.heterofl_models, cls.heterofl_needs)}

    @classmethod
    def pair_key(cls, cfg: DictConfig) -> str:
        return "fedavg/heterofl" if cfg.method.get("family") == "heterofl" else cls.name
