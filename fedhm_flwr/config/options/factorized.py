"""The options of the methods that train factorized (low-rank) models: FedHM and PriSM / OrthDrop
(docs/METHODS.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import choice, flags, num_in
from fedhm_flwr.config.options.base import CONV_ARCHS, MethodOptions, check_rho, check_tau


@dataclass(frozen=True)
class FedHMOptions(MethodOptions):
    name = "fedhm"
    models = (*CONV_ARCHS, "vit", "custom")
    needs = "Conv2d/Linear layers to factorize (cnn, resnet18, resnet34, vit, or a model.target)"

    tau: float
    weight_by_samples: bool
    rho: int | None
    frobenius_decay: bool
    svd_tolerance: float | None  # None: fedhm_flwr.math.lowrank.SVD_TOLERANCE (FedAvg of FedHM's family)
    official_weights: bool
    add_previous_global: bool

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        check_tau(cfg)
        check_rho(cfg)
        flags(
            cfg,
            "method.weight_by_samples",
            "method.frobenius_decay",
            "method.official_weights",
            "method.add_previous_global",
        )
        if OmegaConf.select(cfg, "method.svd_tolerance") is not None:  # null: the method's own default
            num_in(cfg, "method.svd_tolerance", 0.0, 1.0, low_open=True, high_open=True)


@dataclass(frozen=True)
class PriSMOptions(MethodOptions):
    """PriSM / OrthDrop: kernel selection rule, kappa, rho, the U-subset option (levels: keep ratios)."""

    name = "prism"
    models = CONV_ARCHS
    needs = "the built-in conv nets' kernel layout (cnn/resnet18/resnet34), since PriSM samples conv kernels"

    sampling: str
    kappa: float
    rho: int | None
    u_subset: bool
    u_subset_rows: str
    frobenius_decay: bool

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        choice(cfg, "method.sampling", ("prism", "orthdrop", "uniform", "softmax"))
        num_in(cfg, "method.kappa", 0.0, math.inf, high_open=True)
        check_rho(cfg, "null (the model's FedHM default) or an integer >= 0 (0: every factorizable layer)")
        flags(cfg, "method.u_subset", "method.frobenius_decay")
        choice(cfg, "method.u_subset_rows", ("first", "random"))
