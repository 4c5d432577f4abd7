"""The options of the methods that train factorized (low-rank) models: FedHM and PriSM / OrthDrop
(docs/METHODS.md)."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic.dataclasses import dataclass

from fedhm_flwr.config.options.base import (
    CONV_ARCHS,
    MethodOptions,
    Rho,
    Tau,
    frobenius_decay,
    rho,
    tau,
    weight_by_samples,
)
from fedhm_flwr.config.options.declare import DECLARED, Flag, Num, OneOf, Text, option
from fedhm_flwr.config.options.sections import ROBUST


@dataclass(frozen=True, config=DECLARED)
class FedHMOptions(MethodOptions):
    name = "fedhm"
    models = (*CONV_ARCHS, "vit", "custom")
    needs = "Conv2d/Linear layers to factorize (cnn, resnet18, resnet34, vit, or a model.target)"

    tau: Tau = tau(1.0)
    weight_by_samples: Flag = weight_by_samples(False)
    rho: Rho = rho(None)
    frobenius_decay: Flag = frobenius_decay(True)
    # None: fedhm_flwr.math.lowrank.SVD_TOLERANCE (FedAvg of FedHM's family)
    svd_tolerance: Num | None = option(
        1.0e-3,
        "a hand-out is the exact SVD truncation of a weight within this relative distance",
        allowed="a number in (0.0, 1.0)",
        gt=0.0,
        lt=1.0,
    )
    official_weights: Flag = option(
        False, "official code: weights softmax(-(1/gamma) / tau) with levels.assignment=dynamic, uniform with fixed"
    )
    add_previous_global: Flag = option(
        False, "official code: a round without a full-rank reply adds the previous global model at gamma = 1"
    )

    def robust_modes(self) -> tuple[str, ...]:
        return ROBUST  # recovered full-shape updates: every mode, Krum and DP too


@dataclass(frozen=True, config=DECLARED)
class PriSMOptions(MethodOptions):
    """PriSM / OrthDrop: kernel selection rule, kappa, rho, the U-subset option (levels: keep ratios)."""

    name = "prism"
    models = CONV_ARCHS
    needs = "the built-in conv nets' kernel layout (cnn/resnet18/resnet34), since PriSM samples conv kernels"

    sampling: Annotated[Text, OneOf(("prism", "orthdrop", "uniform", "softmax"))] = option(
        "prism", "prism: p ~ sigma^kappa | orthdrop: top-k kernels | uniform | softmax: p = softmax(sigma)"
    )
    kappa: Num = option(2.5, "smoothing exponent of p ~ sigma^kappa", ge=0.0, lt=math.inf)
    rho: Rho = rho(0, "null (the model's FedHM default) or an integer >= 0 (0: every factorizable layer)")
    u_subset: Flag = option(False, "memory option: Conv_U computes only r of the layer's output channels")
    u_subset_rows: Annotated[Text, OneOf(("first", "random"))] = option(
        "first", "which ones: first (the paper's u_i(1:r)) | random (per client and round)"
    )
    frobenius_decay: Flag = frobenius_decay(True)
