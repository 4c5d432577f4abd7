"""The options of FIARSE, importance-aware sub-model extraction (docs/METHODS.md#fiarse)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import choice, num_in, require
from fedhm_flwr.config.options.base import CONV_ARCHS, MethodOptions

#: the gradient rules of a masked weight (:data:`fedhm_flwr.math.fiarse.GRADIENTS`; config stays torch-free)
GRADIENTS = ("masked", "bern")


@dataclass(frozen=True)
class FIARSEOptions(MethodOptions):
    """FIARSE: a level is a size, the fraction of the conv/linear weights a client keeps by magnitude
    (one global threshold); the server's learning rate and the gradient rule of the masked weights."""

    name = "fiarse"
    models = CONV_ARCHS
    needs = "a built-in conv net (cnn, resnet18, resnet34), whose Conv2d and Linear weights FIARSE masks"

    server_lr: float
    gradient: str

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        num_in(cfg, "method.server_lr", 0.0, math.inf, low_open=True, high_open=True)
        choice(cfg, "method.gradient", GRADIENTS)
        match = OmegaConf.select(cfg, "levels.match") or "none"
        require(
            match == "none",
            "levels.match",
            match,
            "none for method=fiarse (a level is the fraction kept by magnitude, no width to match to FedHM's "
            "levels; fedhm compare --match none)",
        )
