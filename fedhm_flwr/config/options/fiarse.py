"""The options of FIARSE, importance-aware sub-model extraction (docs/METHODS.md#fiarse)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic.dataclasses import dataclass

from fedhm_flwr.config.options.base import CONV_ARCHS, MethodOptions
from fedhm_flwr.config.options.declare import DECLARED, Num, OneOf, Text, option
from fedhm_flwr.core.errors import ConfigError

#: the gradient rules of a masked weight (:data:`fedhm_flwr.math.fiarse.GRADIENTS`; config stays torch-free)
GRADIENTS = ("masked", "bern")
#: levels.match values FIARSE takes: the levels as sizes, or sizes keeping FedHM's parameter count
MATCHES = ("none", "fedhm_params")


@dataclass(frozen=True, config=DECLARED)
class FIARSEOptions(MethodOptions):
    """FIARSE: a level is a size, the fraction of the conv/linear weights a client keeps by magnitude
    (one global threshold); the server's learning rate and the gradient rule of the masked weights."""

    name = "fiarse"
    models = CONV_ARCHS
    needs = "a built-in conv net (cnn, resnet18, resnet34), whose Conv2d and Linear weights FIARSE masks"

    server_lr: Num = option(
        1.0, "the server's learning rate on the averaged update (the official --lr-global)", gt=0.0, lt=math.inf
    )
    gradient: Annotated[Text, OneOf(GRADIENTS)] = option(
        "masked", "masked: g * 1[|w| >= theta] (the official code's) | bern: the Bern function's written backward"
    )

    def across(self, config: Mapping[str, Any]) -> None:
        """A level is the fraction kept by magnitude: it can match FedHM's level on the parameters it
        keeps (``fedhm_params``); a masked sub-model computes and holds dense tensors, so MACs and
        training memory have nothing to match."""
        match = (config.get("levels") or {}).get("match") or "none"
        if match not in MATCHES:
            raise ConfigError(
                "levels.match",
                match,
                f"one of {list(MATCHES)} for method=fiarse (a level is the fraction kept by magnitude: it matches "
                "FedHM's parameters kept; its MACs and training memory are the dense model's at every size)",
            )
