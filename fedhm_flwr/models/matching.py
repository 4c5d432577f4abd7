"""HeteroFL / FedRolex widths matched to FedHM's levels by parameter count (the FedHM journal's
budget matching, ``levels.match=fedhm_params``; docs/METHODS.md#heterofl). Counted on models built
on the meta device (nothing allocated). No Flower import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedhm_flwr.math.width import full_spec, submodel_spec
from fedhm_flwr.models import build_model, shape_device
from fedhm_flwr.models.costs import count_parameters
from fedhm_flwr.models.rules import plan_ranks

__all__ = ["MATCH_STEP", "fedhm_level_params", "matched_rate", "matched_rates", "submodel_params"]

#: resolution of a matched width rate (finer than one channel of a 512-channel layer)
MATCH_STEP = 1e-3


def submodel_params(spec: Mapping[str, Any], rate: float) -> int:
    """Trainable parameters of the rate-``rate`` sub-model of ``spec`` (counted on the meta device)."""
    with torch.device("meta"):
        return count_parameters(build_model(submodel_spec(spec, rate)))


def fedhm_level_params(spec: Mapping[str, Any], gammas: Sequence[float], rho: int | None = None) -> list[int]:
    """Trainable parameters of FedHM's hybrid model at each rank ratio (``rho``: the model's default
    when None), for the same model ``spec``."""
    base = full_spec(spec)
    with shape_device(base):
        model = build_model(base)
        out = []
        for gamma in gammas:
            ranks = plan_ranks(model, float(gamma), rho)
            level = build_model({**base, "ranks": ranks}, spectral_init=False) if ranks else model
            out.append(count_parameters(level))
    return out


def matched_rate(spec: Mapping[str, Any], target: int, step: float = MATCH_STEP) -> float:
    """The width rate (a multiple of ``step`` in (0, 1]) whose sub-model's parameter count is the
    closest to ``target`` (the smaller rate on a tie). The count never decreases with the rate, so
    the rate is found by bisection over the grid."""
    grid = int(round(1 / step))
    lo, hi = 1, grid  # find the smallest grid index whose count reaches the target
    if submodel_params(spec, hi * step) <= target:
        return 1.0
    while lo < hi:
        mid = (lo + hi) // 2
        if submodel_params(spec, mid * step) >= target:
            hi = mid
        else:
            lo = mid + 1
    candidates = [i for i in (lo - 1, lo) if i >= 1]
    best = min(candidates, key=lambda i: (abs(submodel_params(spec, i * step) - target), i))
    return round(best * step, 6)


def matched_rates(spec: Mapping[str, Any], gammas: Sequence[float], rho: int | None = None) -> tuple[list[float], list[int]]:
    """(width rates, FedHM parameter counts): for every rank ratio ``gamma``, the width rate whose
    sub-model has the parameter count closest to FedHM's level ``gamma`` on the same model (the
    FedHM journal's budget matching: widths about 1 / 0.64 / 0.5 / 0.35 against gamma = 1, 1/2,
    1/4, 1/8 on ResNet-18)."""
    targets = fedhm_level_params(spec, gammas, rho)
    return [matched_rate(spec, t) for t in targets], targets
