"""The options of the methods that slice channel widths: HeteroFL, FedRolex and FjORD
(docs/METHODS.md)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import flags, is_num, require
from fedhm_flwr.config.options.base import BY_WIDTH, CONV_ARCHS, MethodOptions, check_grad_clip


@dataclass(frozen=True)
class WidthOptions(MethodOptions):
    """HeteroFL / FedRolex: levels are width rates in (0, 1] (checked with ``levels``)."""

    models = CONV_ARCHS

    scaler: bool
    grad_clip: float
    weight_by_samples: bool

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        flags(cfg, "method.scaler")
        check_grad_clip(cfg)
        flags(cfg, "method.weight_by_samples")


@dataclass(frozen=True)
class HeteroFLOptions(WidthOptions):
    name = "heterofl"
    needs = BY_WIDTH + "HeteroFL slices channel widths"


@dataclass(frozen=True)
class FedRolexOptions(WidthOptions):
    name = "fedrolex"
    needs = BY_WIDTH + "FedRolex rolls channel windows"


@dataclass(frozen=True)
class FjORDOptions(MethodOptions):
    """FjORD: levels are p_max widths; the widths P drawn per batch (``method.p_values``, null:
    the levels' own), knowledge distillation, clipping, weights by sample count."""

    name = "fjord"
    models = CONV_ARCHS
    needs = BY_WIDTH + "FjORD trains nested channel widths"

    p_values: tuple[float, ...] | None
    distill: bool
    grad_clip: float
    weight_by_samples: bool

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        check_grad_clip(cfg)
        flags(cfg, "method.weight_by_samples", "method.distill")
        p_values = OmegaConf.select(cfg, "method.p_values")
        if p_values is None:
            return
        ratios = list(OmegaConf.select(cfg, "levels.ratios") or [])
        match = OmegaConf.select(cfg, "levels.match") or "none"
        plain = list(p_values) if OmegaConf.is_list(p_values) else p_values
        require(
            match == "none",
            "method.p_values",
            plain,
            f"null with levels.match={match} (the widths drawn are then the matched rates)",
        )
        require(
            isinstance(plain, list)
            and plain
            and all(is_num(p) and 0 < p <= 1 for p in plain)
            and all(r in plain for r in ratios),
            "method.p_values",
            plain,
            f"null (the levels) or a list of widths in (0, 1] holding every level of levels.ratios {ratios}",
        )
