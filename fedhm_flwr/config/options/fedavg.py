"""The options of homogeneous FedAvg, the baseline run on FedHM's or HeteroFL's models
(docs/METHODS.md)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from fedhm_flwr.config.checks import choice, flags
from fedhm_flwr.config.options.base import BY_WIDTH, CONV_ARCHS, MethodOptions, check_grad_clip, check_rho


@dataclass(frozen=True)
class FedAvgOptions(MethodOptions):
    """Homogeneous FedAvg: the full model, or the smallest level of FedHM or HeteroFL; with
    ``method.family=heterofl`` it runs on HeteroFL's models (pair key ``fedavg/heterofl``)."""

    name = "fedavg"
    models = (*CONV_ARCHS, "vit", "custom")
    needs = "an image classifier (cnn, resnet18, resnet34, vit, or a model.target)"
    heterofl_models = CONV_ARCHS
    heterofl_needs = BY_WIDTH + "method.family=heterofl slices widths"

    variant: str
    family: str
    rho: int | None
    frobenius_decay: bool
    scaler: bool
    grad_clip: float

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        choice(cfg, "method.variant", ("full", "smallest"))
        choice(cfg, "method.family", ("fedhm", "heterofl"))
        check_rho(cfg)
        flags(cfg, "method.frobenius_decay", "method.scaler")
        check_grad_clip(cfg, used=cfg.method.get("family") == "heterofl")  # family fedhm: train.grad_clip

    @classmethod
    def pairs(cls) -> dict[str, tuple[tuple[str, ...], str]]:
        return {**super().pairs(), "fedavg/heterofl": (cls.heterofl_models, cls.heterofl_needs)}

    @classmethod
    def pair_key(cls, cfg: DictConfig) -> str:
        return "fedavg/heterofl" if cfg.method.get("family") == "heterofl" else cls.name
