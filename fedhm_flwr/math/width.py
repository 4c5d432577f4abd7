"""Width slicing of HeteroFL and FedRolex (docs/METHODS.md#heterofl): pure functions on tensors, no Flower.

A level is a width rate ``r`` in (0, 1]. Its sub-model is the same architecture with fewer
channels:

* every hidden layer keeps ``ceil(r·C)`` of its ``C`` output channels (:func:`scaled_channels`;
  the stem included);
* the input image channels and the classifier outputs are always full;
* a layer's input channels are the output channels of the layer feeding it (a shortcut takes the
  same input channels as its block's first conv; the classifier input follows the last hidden
  layer); normalisation parameters follow their conv's output channels.

Which channels: HeteroFL (``mode="static"``) keeps the first ``k = ceil(r·K)`` of a layer's ``K``
channels. FedRolex (``mode="rolling"``) keeps ``{(i + j) mod K : i < k}`` in round ``j``: the window
moves forward one channel per round and wraps. **Round counting:** ``j = server_round - 1``, so
Flower's first round (``server_round = 1``) uses the window start 0, i.e. the first ``k``
channels, exactly HeteroFL's slice (:func:`window_start`). All clients of a round share ``j``.
The kept indices are returned sorted. Because the index set of a layer depends only on its
channel count ``K`` (and the rate, mode and round), a layer's output indices are automatically
the next layer's input indices and a residual stream keeps the same channels throughout.

A *plan* (:func:`index_plan`) maps every key of the full model's state dict to one entry per
dimension of that tensor: a sorted ``LongTensor`` of kept indices, or ``None`` (dimension kept
whole). :func:`slice_state` cuts a sub-model's state out of the global one (its shapes equal the
sub-model's ``state_dict()``); :func:`accumulate` / :func:`finish` (or :func:`aggregate` for the
whole round) fold replies back: every element becomes the mean over the clients whose sub-model
held it, classifier rows only over clients holding that class, elements nobody trained keep their
values. The mean is plain (unweighted), as in HeteroFL's eq. (1)-(3) (``1/m Σ``, ``1/(m - m_p) Σ``);
an optional per-client weight (e.g. the sample count) is supported.

HeteroFL's Scaler (divides activations by the rate in training, identity in evaluation; the models
put it right before each normalisation layer) is :class:`fedhm_flwr.models.layers.Scaler`; the
width rates matched to FedHM's parameter counts are :mod:`fedhm_flwr.models.matching`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

State = dict[str, Tensor]
#: state key -> one entry per dimension: kept indices (sorted LongTensor) or None (whole dimension)
Plan = dict[str, tuple[Tensor | None, ...]]

MODES = ("static", "rolling")

#: model spec keys that describe a sub-model, not the full model
SUBMODEL_KEYS = ("width_rate", "scaler")


# --------------------------------------------------------------------------------------------
# Channel rule
# --------------------------------------------------------------------------------------------


def check_rate(rate: float) -> float:
    """A width rate must be a number in (0, 1]."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"width rate must be a number in (0, 1], got {rate!r}")
    return float(rate)


def scaled_channels(channels: int, rate: float) -> int:
    """``ceil(rate · channels)`` (at least 1) kept by a hidden layer of ``channels`` channels.

    A tolerance of 1e-9 absorbs float noise so that a product meant to be an integer (``0.35·20``
    evaluates to ``7.000000000000001``) is not rounded up to the next channel.
    """
    rate = check_rate(rate)
    if int(channels) < 1:
        raise ValueError(f"channels must be >= 1, got {channels!r}")
    return min(int(channels), max(1, math.ceil(rate * int(channels) - 1e-9)))


def window_start(server_round: int) -> int:
    """FedRolex's window start ``j`` of a round: ``server_round - 1`` (round 1 starts at 0)."""
    if isinstance(server_round, bool) or not isinstance(server_round, int) or server_round < 1:
        raise ValueError(f"server_round must be an integer >= 1, got {server_round!r}")
    return server_round - 1


def channel_indices(channels: int, rate: float, mode: str = "static", server_round: int = 1) -> Tensor:
    """Sorted indices kept of a layer with ``channels`` channels (see the module docstring)."""
    k = scaled_channels(channels, rate)
    if mode == "static":
        return torch.arange(k)
    if mode == "rolling":
        j = window_start(server_round)
        return torch.sort((torch.arange(k) + j) % int(channels)).values
    raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")


# --------------------------------------------------------------------------------------------
# Index plans
# --------------------------------------------------------------------------------------------


def full_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The full model's spec of a (sub-)model spec: without ``width_rate`` / ``scaler``."""
    return {k: v for k, v in spec.items() if k not in SUBMODEL_KEYS}


def submodel_spec(spec: Mapping[str, Any], rate: float, scaler: bool = True) -> dict[str, Any]:
    """The spec of the rate-``rate`` sub-model of the full model ``spec``.

    Rate 1 gives the full spec itself (the sub-model is the full model; a Scaler would divide by
    1), so a full-rate level and the global model are the same model.
    """
    rate = check_rate(rate)
    base = full_spec(spec)
    if rate == 1.0:
        return base
    return {**base, "width_rate": rate, "scaler": bool(scaler)}


def _input_layer(model: nn.Module) -> str:
    """The layer that reads the input image: the first Conv2d/Linear registered (the stem)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            return name
    raise ValueError(f"{type(model).__name__} has no Conv2d or Linear layer")


def index_plan(
    model: nn.Module,
    rate: float,
    mode: str = "static",
    server_round: int = 1,
) -> Plan:
    """The per-tensor index plan of the rate-``rate`` sub-model of a full model (its shapes suffice:
    a model built on the meta device will do).

    Every key of the full model's ``state_dict()`` gets one entry per dimension. Conv and hidden
    Linear weights ``(out, in, ...)``: out = the layer's kept channels, in = the kept channels of
    its input (whole for the stem, which reads the image); biases and normalisation tensors follow
    their layer's output channels; the classifier (``model.classifier_name``, default ``fc``)
    keeps all its outputs and takes the last hidden layer's kept channels. Grouped convolutions
    and layer types other than Conv2d / Linear / BatchNorm are refused.
    """
    check_rate(rate)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "rolling":
        window_start(server_round)
    stem = _input_layer(model)
    classifier = getattr(model, "classifier_name", "fc")
    cache: dict[int, Tensor] = {}

    def keep(channels: int) -> Tensor:
        if channels not in cache:
            cache[channels] = channel_indices(channels, rate, mode, server_round)
        return cache[channels]

    plan: Plan = {}
    for key, tensor in model.state_dict().items():
        owner_name, _, leaf = key.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if isinstance(owner, (nn.Conv2d, nn.Linear)):
            if isinstance(owner, nn.Conv2d) and owner.groups != 1:
                raise ValueError(f"{owner_name}: grouped convolutions cannot be width-sliced")
            out_ch = owner.out_channels if isinstance(owner, nn.Conv2d) else owner.out_features
            in_ch = owner.in_channels if isinstance(owner, nn.Conv2d) else owner.in_features
            out_idx = None if owner_name == classifier else keep(out_ch)
            if leaf == "weight":
                in_idx = None if owner_name == stem else keep(in_ch)
                plan[key] = (out_idx, in_idx) + (None,) * (tensor.dim() - 2)
            else:  # bias
                plan[key] = (out_idx,)
        elif isinstance(owner, nn.modules.batchnorm._NormBase):
            plan[key] = (keep(owner.num_features),) if tensor.dim() == 1 else (None,) * tensor.dim()
        else:
            raise ValueError(f"{key}: {type(owner).__name__} layers cannot be width-sliced")
    return plan


def _add_into(total: Tensor, entry: tuple[Tensor | None, ...], values: Tensor) -> None:
    """``total[ix_(entry)] += values`` in place, one sliced dimension at a time.

    Index-select / index-copy along one dimension per step: memory traffic of the order of the
    tensor, unlike advanced indexing with an open mesh (one index per element).
    """
    for d, idx in enumerate(entry):
        if idx is not None:
            idx = idx.to(total.device)
            part = total.index_select(d, idx)
            _add_into(part, entry[:d] + (None,) + entry[d + 1 :], values)
            total.index_copy_(d, idx, part)
            return
    total += values


def sub_shape(entry: tuple[Tensor | None, ...], shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the sliced tensor."""
    return tuple(size if idx is None else len(idx) for idx, size in zip(entry, shape))


def slice_state(full_state: Mapping[str, Tensor], plan: Plan) -> State:
    """The sub-model's state: every tensor cut down to the plan's indices (fresh, contiguous).

    Keys and order follow ``full_state`` (= the sub-model's ``state_dict()`` keys); a key the
    plan does not name is refused.
    """
    out: State = {}
    for key, value in full_state.items():
        if key not in plan:
            raise KeyError(f"the index plan has no entry for {key!r}")
        entry = plan[key]
        if len(entry) != value.dim():
            raise ValueError(f"{key}: plan has {len(entry)} dimensions, tensor {tuple(value.shape)}")
        t = value.detach()
        for d, idx in enumerate(entry):
            if idx is not None:
                t = t.index_select(d, idx.to(t.device))
        out[key] = t.contiguous() if any(idx is not None for idx in entry) else t.clone()
    return out


def embed(
    sub_state: Mapping[str, Tensor], plan: Plan, full_shapes: Mapping[str, Sequence[int]]
) -> tuple[State, dict[str, Tensor]]:
    """(values, mask) in full shape: the sub-model's elements placed where they came from
    (zeros elsewhere) and a boolean mask of the positions it holds."""
    values: State = {}
    masks: dict[str, Tensor] = {}
    for key, shape in full_shapes.items():
        sub = sub_state[key]
        if tuple(sub.shape) != sub_shape(plan[key], shape):
            raise ValueError(f"{key}: shape {tuple(sub.shape)} does not match the plan {sub_shape(plan[key], shape)}")
        values[key] = torch.zeros(tuple(shape), dtype=sub.dtype)
        _add_into(values[key], plan[key], sub)
        held = torch.zeros(tuple(shape), dtype=torch.uint8)
        _add_into(held, plan[key], torch.ones_like(sub, dtype=torch.uint8))
        masks[key] = held.bool()
    return values, masks


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def new_sums(previous: Mapping[str, Tensor]) -> tuple[State, State]:
    """Zeroed (sums, weights) accumulators in the global model's shapes (float64)."""
    sums = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in previous.items()}
    return sums, {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in previous.items()}


def accumulate(
    sums: State,
    weights: State,
    sub_state: Mapping[str, Tensor],
    plan: Plan,
    weight: float = 1.0,
    class_holds: Sequence[bool] | np.ndarray | Tensor | None = None,
    classifier_keys: Sequence[str] = (),
) -> None:
    """Add one client's sub-model into the accumulators (in place).

    Each element the sub-model holds adds ``weight · value`` to ``sums`` and ``weight`` to
    ``weights``. For ``classifier_keys`` (first dimension = class) only the rows of classes in
    ``class_holds`` (a boolean per class, e.g. ``class_counts > 0``) are added.
    """
    if not weight > 0:
        raise ValueError(f"weight must be > 0, got {weight!r}")
    holds = None if class_holds is None else torch.as_tensor(np.asarray(class_holds, dtype=bool))
    for key, total in sums.items():
        if key not in sub_state:
            raise KeyError(f"client state lacks {key!r}")
        sub = sub_state[key].detach().to(torch.float64)
        entry = plan[key]
        expected = sub_shape(entry, total.shape)
        if tuple(sub.shape) != expected:
            raise ValueError(f"{key}: shape {tuple(sub.shape)}, the plan needs {expected}")
        w = torch.full(expected, float(weight), dtype=torch.float64)
        if holds is not None and key in classifier_keys:
            rows = holds if entry[0] is None else holds[entry[0]]
            if rows.shape[0] != expected[0]:
                raise ValueError(f"{key}: {rows.shape[0]} class flags for {expected[0]} rows")
            w = w * rows.to(torch.float64).view(-1, *([1] * (sub.dim() - 1)))
        _add_into(total, entry, w * sub)
        _add_into(weights[key], entry, w)


def finish(previous: Mapping[str, Tensor], sums: State, weights: State) -> State:
    """The new global state: ``sums / weights`` where anyone contributed, else ``previous``."""
    out: State = {}
    for key, prev in previous.items():
        held = weights[key] > 0
        mean = sums[key] / weights[key].clamp_min(1e-300)
        out[key] = torch.where(held, mean, prev.to(torch.float64)).to(prev.dtype)
    return out


def aggregate(
    previous: Mapping[str, Tensor],
    sub_states: Sequence[Mapping[str, Tensor]],
    plans: Sequence[Plan],
    weights: Sequence[float] | None = None,
    class_holds: np.ndarray | None = None,
    classifier_keys: Sequence[str] = (),
) -> State:
    """One round of element-wise aggregation (HeteroFL eq. 1-3; FedRolex): see :func:`accumulate`.

    ``weights`` default to 1 per client (plain mean over the holders); ``class_holds`` is a
    (clients x classes) boolean matrix.
    """
    if len(sub_states) != len(plans) or not sub_states:
        raise ValueError("need one plan per client state, and at least one state")
    w = [1.0] * len(sub_states) if weights is None else [float(x) for x in weights]
    if len(w) != len(sub_states):
        raise ValueError("need one weight per client state")
    sums, totals = new_sums(previous)
    for i, (state, plan) in enumerate(zip(sub_states, plans)):
        holds = None if class_holds is None else class_holds[i]
        accumulate(sums, totals, state, plan, w[i], holds, classifier_keys)
    return finish(previous, sums, totals)
