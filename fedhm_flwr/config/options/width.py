"""The options of the methods that slice channel widths: HeteroFL, FedRolex and FjORD
(docs/METHODS.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Strict, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Self

from fedhm_flwr.config.options.base import (
    BY_WIDTH,
    CONV_ARCHS,
    ELEMENTWISE_MODES,
    MethodOptions,
    grad_clip,
    weight_by_samples,
)
from fedhm_flwr.config.options.declare import DECLARED, Flag, Num, Refused, option
from fedhm_flwr.core.errors import ConfigError


@dataclass(frozen=True, config=DECLARED)
class WidthOptions(MethodOptions):
    """HeteroFL / FedRolex: levels are width rates in (0, 1] (checked with ``levels``)."""

    models = CONV_ARCHS

    scaler: Flag = option(True, "Scaler: activations / rate before each norm, in training only")
    grad_clip: Num = grad_clip(1.0)
    weight_by_samples: Flag = weight_by_samples(False)

    def clips(self) -> float | None:
        return self.grad_clip

    def robust_modes(self) -> tuple[str, ...]:
        return ELEMENTWISE_MODES


@dataclass(frozen=True, config=DECLARED)
class HeteroFLOptions(WidthOptions):
    name = "heterofl"
    needs = BY_WIDTH + "HeteroFL slices channel widths"


@dataclass(frozen=True, config=DECLARED)
class FedRolexOptions(WidthOptions):
    name = "fedrolex"
    needs = BY_WIDTH + "FedRolex rolls channel windows"


_P_VALUES = "null (the levels) or a list of widths in (0, 1] holding every level of levels.ratios"


@dataclass(frozen=True, config=DECLARED)
class FjORDOptions(MethodOptions):
    """FjORD: levels are p_max widths; the widths P drawn per batch (``method.p_values``, null:
    the levels' own), knowledge distillation, clipping, weights by sample count."""

    name = "fjord"
    models = CONV_ARCHS
    needs = BY_WIDTH + "FjORD trains nested channel widths"

    p_values: tuple[Annotated[float, Strict()], ...] | None = option(
        None, "the widths P drawn per batch (null: the levels' widths; must hold every level)", allowed=_P_VALUES
    )
    distill: Flag = option(False, "knowledge distillation: p_max learns the labels, the drawn width p_max's softmax")
    grad_clip: Num = grad_clip(0.0)
    weight_by_samples: Flag = weight_by_samples(True)

    def clips(self) -> float | None:
        return self.grad_clip

    @model_validator(mode="after")
    def _widths(self) -> Self:
        if self.p_values is not None and not (self.p_values and all(0 < p <= 1 for p in self.p_values)):
            raise Refused("p_values")
        return self

    def across(self, config: Mapping[str, Any]) -> None:
        """``method.p_values`` against ``levels.ratios`` and ``levels.match``."""
        if self.p_values is None:
            return
        levels = config.get("levels") or {}
        ratios, match = list(levels.get("ratios") or []), levels.get("match") or "none"
        plain = list(self.p_values)
        if match != "none":
            raise ConfigError(
                "method.p_values",
                plain,
                f"null with levels.match={match} (the widths drawn are then the matched rates)",
            )
        if not all(r in plain for r in ratios):
            raise ConfigError("method.p_values", plain, f"{_P_VALUES} {ratios}")
