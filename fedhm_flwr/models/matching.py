"""HeteroFL / FedRolex widths matched to FedHM's levels on one resource (the FedHM journal's
budget matching on parameters, ``levels.match=fedhm_params``, and the same on the other two
resources a device may be short of: ``fedhm_macs`` (compute) and ``fedhm_memory`` (training memory);
docs/METHODS.md#heterofl). Counted on models built on the meta device (nothing allocated). No
Flower import.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedhm_flwr.math.width import full_spec, submodel_spec
from fedhm_flwr.models import build_model, input_shape, shape_device
from fedhm_flwr.models.costs import count_parameters, model_costs
from fedhm_flwr.models.rules import plan_ranks

__all__ = [
    "MATCH_STEP",
    "RESOURCES",
    "fedhm_level_costs",
    "fedhm_level_params",
    "matched_rate",
    "matched_rates",
    "submodel_cost",
    "submodel_params",
]

#: resolution of a matched width rate (finer than one channel of a 512-channel layer)
MATCH_STEP = 1e-3
#: what a budget can be matched on: trainable parameters (= bytes on the wire), MACs of one forward
#: pass of one input (compute), estimated peak training memory (:func:`fedhm_flwr.models.costs.model_costs`)
RESOURCES = ("params", "macs", "memory")


def _check_resource(resource: str) -> None:
    if resource not in RESOURCES:
        raise ValueError(f"resource={resource!r}; allowed: {', '.join(RESOURCES)}")


def _spec_cost(spec: Mapping[str, Any], resource: str, batch_size: int, momentum: float) -> float:
    return _counted_cost(json.dumps(spec, sort_keys=True, default=str), resource, int(batch_size), float(momentum))


@functools.lru_cache(maxsize=4096)
def _counted_cost(spec_json: str, resource: str, batch_size: int, momentum: float) -> float:
    """``resource`` of the model ``spec_json`` describes, counted once per process: a bisection asks for the
    same sub-models again for every level, and every strategy of a run (a study builds one per method) for
    the same levels. Parameters are counted without a forward pass (:func:`model_costs` runs two)."""
    spec = json.loads(spec_json)
    with shape_device(spec):
        model = build_model(spec, spectral_init=False)
        if resource == "params":
            return float(count_parameters(model))
        return model_costs(model, input_shape(spec), batch_size, momentum)[resource]


def submodel_cost(
    spec: Mapping[str, Any], rate: float, resource: str = "params", batch_size: int = 32, momentum: float = 0.9
) -> float:
    """``resource`` of the rate-``rate`` sub-model of ``spec`` (memory: training at ``batch_size``,
    one optimizer slot when ``momentum`` > 0)."""
    _check_resource(resource)
    return _spec_cost(submodel_spec(spec, rate), resource, batch_size, momentum)


def submodel_params(spec: Mapping[str, Any], rate: float) -> int:
    """Trainable parameters of the rate-``rate`` sub-model of ``spec``."""
    return int(submodel_cost(spec, rate, "params"))


def fedhm_level_costs(
    spec: Mapping[str, Any],
    gammas: Sequence[float],
    rho: int | None = None,
    resource: str = "params",
    batch_size: int = 32,
    momentum: float = 0.9,
) -> list[float]:
    """``resource`` of FedHM's hybrid model at each rank ratio (``rho``: the model's default when
    None), for the same model ``spec``."""
    _check_resource(resource)
    base = full_spec(spec)
    with shape_device(base):
        model = build_model(base)
        plans = [plan_ranks(model, float(gamma), rho) for gamma in gammas]
    return [_spec_cost({**base, "ranks": ranks} if ranks else base, resource, batch_size, momentum) for ranks in plans]


def fedhm_level_params(spec: Mapping[str, Any], gammas: Sequence[float], rho: int | None = None) -> list[int]:
    """Trainable parameters of FedHM's hybrid model at each rank ratio."""
    return [int(c) for c in fedhm_level_costs(spec, gammas, rho, "params")]


def matched_rate(
    spec: Mapping[str, Any],
    target: float,
    step: float = MATCH_STEP,
    cost: Callable[[Mapping[str, Any], float], float] = submodel_params,
) -> float:
    """The width rate (a multiple of ``step`` in (0, 1]) whose sub-model's ``cost`` (default: its
    parameter count) is the closest to ``target`` (the smaller rate on a tie). Every cost never
    decreases with the rate, so the rate is found by bisection over the grid."""
    grid = int(round(1 / step))
    lo, hi = 1, grid  # find the smallest grid index whose cost reaches the target
    if cost(spec, hi * step) <= target:
        return 1.0
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(spec, mid * step) >= target:
            hi = mid
        else:
            lo = mid + 1
    candidates = [i for i in (lo - 1, lo) if i >= 1]
    best = min(candidates, key=lambda i: (abs(cost(spec, i * step) - target), i))
    return round(best * step, 6)


def matched_rates(
    spec: Mapping[str, Any],
    gammas: Sequence[float],
    rho: int | None = None,
    resource: str = "params",
    batch_size: int = 32,
    momentum: float = 0.9,
) -> tuple[list[float], list[float]]:
    """(width rates, FedHM's costs): for every rank ratio ``gamma``, the width rate whose sub-model's
    ``resource`` is the closest to FedHM's level ``gamma`` on the same model (on parameters, the
    FedHM journal's budget matching: widths about 1 / 0.64 / 0.5 / 0.35 against gamma = 1, 1/2,
    1/4, 1/8 on ResNet-18)."""
    targets = fedhm_level_costs(spec, gammas, rho, resource, batch_size, momentum)

    def cost(s: Mapping[str, Any], rate: float) -> float:
        return submodel_cost(s, rate, resource, batch_size, momentum)

    return [matched_rate(spec, t, cost=cost) for t in targets], targets
