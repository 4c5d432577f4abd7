"""Aggregation math shared by the methods: pure functions on tensors, no Flower import.

* :func:`level_weights`: FedHM's ``alpha_p = softmax(gamma_p / tau)`` over the clients of a round
  (journal eq. 2), ``tau = inf`` giving the plain mean, optionally multiplied by the clients'
  sample counts and renormalised (FedAvg-style).
* :func:`average_states`: ``w = sum_p alpha_p w_p`` over full-shape states, where the classifier's
  rows (one per class) are averaged only over the clients that hold that class (weights
  renormalised) and a class nobody held keeps its previous row.
* :func:`official_code_weights`: the weights of the published FedHM code, for reproduction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedhm_flwr.math.lowrank import factor_matrices, matrix_to_conv

State = dict[str, torch.Tensor]


def level_weights(
    levels: Sequence[float],
    tau: float = 1.0,
    num_examples: Sequence[int] | None = None,
) -> np.ndarray:
    """Aggregation weights of one round's clients, summing to 1.

    ``levels`` are the clients' levels (rank ratios); ``tau`` the softmax temperature
    (``math.inf`` = uniform). With ``num_examples`` the softmax weights are multiplied by the
    sample counts and renormalised.
    """
    if len(levels) == 0:
        raise ValueError("level_weights needs at least one client")
    if not tau > 0:
        raise ValueError(f"tau must be > 0 (inf for uniform), got {tau!r}")
    g = np.asarray(levels, dtype=np.float64)
    logits = np.zeros_like(g) if math.isinf(tau) else g / tau
    w = np.exp(logits - logits.max())
    if num_examples is not None:
        n = np.asarray(num_examples, dtype=np.float64)
        if n.shape != g.shape or np.any(n <= 0):
            raise ValueError("num_examples must be positive, one per client")
        w = w * n
    return w / w.sum()


def official_code_weights(
    levels: Sequence[float],
    tau: float,
    dynamic: bool,
    num_examples: Sequence[int] | None = None,
) -> np.ndarray:
    """The published FedHM code's aggregation weights (official-code behaviour, not the papers'
    eq.): ``softmax(-(1/gamma_p) / tau)`` when levels are drawn every round (its dynamic flag),
    uniform otherwise; ``num_examples`` as in :func:`level_weights`."""
    if not dynamic:
        return level_weights(levels, math.inf, num_examples)
    if any(not float(g) > 0 for g in levels):
        raise ValueError(f"rank ratios must be > 0, got {list(levels)}")
    return level_weights([-1.0 / float(g) for g in levels], tau, num_examples)


def average_states(
    previous: Mapping[str, torch.Tensor],
    states: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float] | np.ndarray,
    class_holds: np.ndarray | None = None,
    classifier_keys: Sequence[str] = (),
) -> State:
    """Weighted average of full-shape client states.

    ``class_holds`` is a (clients x classes) boolean matrix; when given, every tensor named in
    ``classifier_keys`` (its first dimension indexes classes) is averaged row by row over the
    clients holding that class, with their weights renormalised; rows of classes no client held
    keep ``previous``'s values. Keys missing from ``states`` keep ``previous``'s values.

    The float32 tensors of every client are laid side by side in one (clients x values) matrix and
    averaged by one matrix-vector product (float32, weights summing to 1); other dtypes and the
    per-class keys are averaged key by key in float64.
    """
    if len(states) != len(weights) or not states:
        raise ValueError("need one weight per client state, and at least one state")
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    per_class = set(classifier_keys) if class_holds is not None else set()
    flat = [
        k
        for k, v in previous.items()
        if k in states[0] and k not in per_class and v.dtype == torch.float32 and states[0][k].dtype == torch.float32
    ]
    out: State = dict(zip(flat, stacked_average([[s[k] for k in flat] for s in states], w))) if flat else {}
    rows = [k for k in previous if k in per_class and k in states[0]]
    if rows:
        out.update(_classwise_keys(previous, states, rows, w, torch.as_tensor(class_holds)))
    for key, prev in previous.items():
        if key in out:
            continue
        if key not in states[0]:
            out[key] = prev.clone()
            continue
        out[key] = torch.tensordot(w, torch.stack([s[key].to(torch.float64) for s in states]), dims=1).to(prev.dtype)
    return {key: out[key] for key in previous}


def _classwise_keys(
    previous: Mapping[str, torch.Tensor],
    states: Sequence[Mapping[str, torch.Tensor]],
    keys: Sequence[str],
    w: torch.Tensor,
    holds: torch.Tensor,
) -> State:
    """:func:`classwise_average` of several per-class keys at once (a classifier's weight and bias):
    their class rows side by side, one (clients × classes × values) stack, one average, split back."""
    widths = [previous[k].numel() // previous[k].shape[0] for k in keys]
    # one stack per key (not a join per client: a few ops, not a few per client), widened once
    # (float64 holds every narrower float exactly)
    side = torch.cat(
        [torch.stack([s[k] for s in states]).reshape(len(states), previous[k].shape[0], -1) for k in keys], 2
    ).to(torch.float64)
    prev = torch.cat([previous[k].reshape(previous[k].shape[0], -1) for k in keys], 1).to(torch.float64)
    mixed = classwise_average(prev, side, w, holds)
    return {
        k: part.reshape(previous[k].shape).to(previous[k].dtype)
        for k, part in zip(keys, torch.split(mixed, widths, dim=1))
    }


def stacked_average(tensors: Sequence[Sequence[torch.Tensor]], weights: torch.Tensor) -> list[torch.Tensor]:
    """``sum_i weights[i] * tensors[i][j]`` for every position ``j``, as one product of the
    (clients x values) matrix of the flattened float32 tensors."""
    shapes = [t.shape for t in tensors[0]]
    # (a 1-D tensor joins as it is: no call per bias and norm vector, a round has hundreds)
    flat_values = [t if t.ndim == 1 else t.reshape(-1) for client in tensors for t in client]
    matrix = torch.cat(flat_values).view(len(tensors), -1)
    flat = weights.to(matrix.dtype) @ matrix
    return [part.view(shape) for part, shape in zip(torch.split(flat, [math.prod(s) for s in shapes]), shapes)]


def average_hybrid(
    previous: Mapping[str, torch.Tensor],
    states: Sequence[Mapping[str, torch.Tensor]],
    ranks: Sequence[Mapping[str, int]],
    weights: Sequence[float] | np.ndarray,
    class_holds: np.ndarray | None = None,
    classifier_keys: Sequence[str] = (),
) -> State:
    """:func:`average_states` of hybrid client states (FedHM), without recovering each one.

    ``ranks[i]`` are client ``i``'s factorized layers (its hybrid state holds ``L.b.weight``,
    ``L.a.weight`` and maybe ``L.a.bias``). The weighted sum of a layer's recovered weights,
    ``sum_i w_i A_i B_i``, is one matrix product ``[w_1 A_1 | w_2 A_2 | ...] @ [B_1; B_2; ...]``
    (ranks may differ), plus the weighted sum of the clients that sent the layer full rank.
    Factorized layers must not be per-class keys.
    """
    if not (len(states) == len(ranks) == len(weights)) or not states:
        raise ValueError("need one rank plan and one weight per client state, and at least one state")
    layers = sorted({name for r in ranks for name in r})
    clash = [name for name in layers if f"{name}.weight" in classifier_keys]
    if clash:
        raise ValueError(f"factorized layers {clash} cannot be averaged per class")
    w = np.asarray(weights, dtype=np.float64)
    merged = {f"{name}.weight": _layer_sum(previous[f"{name}.weight"], states, ranks, w, name) for name in layers}
    rest = [_without_factors(s, r) for s, r in zip(states, ranks)]
    others = {k: v for k, v in previous.items() if k not in merged}
    averaged = average_states(others, rest, weights, class_holds, classifier_keys)
    return {key: merged[key] if key in merged else averaged[key] for key in previous}


def _layer_sum(
    previous: torch.Tensor,
    states: Sequence[Mapping[str, torch.Tensor]],
    ranks: Sequence[Mapping[str, int]],
    w: np.ndarray,
    name: str,
) -> torch.Tensor:
    """``sum_i w_i W_i`` of one layer: factorized clients by one stacked product, the others summed."""
    factored = [i for i, r in enumerate(ranks) if name in r]
    full = [i for i, r in enumerate(ranks) if name not in r]
    total = None
    if factored:
        # the clients' factors side by side first, unrolled once (the same matrices as unrolling
        # each client's and joining them), each client's columns times its weight in float32
        a_weights = [_float32(states[i][f"{name}.a.weight"]) for i in factored]
        b_weights = [_float32(states[i][f"{name}.b.weight"]) for i in factored]
        A, B, _ = factor_matrices(torch.cat(a_weights, dim=1), torch.cat(b_weights, dim=0))
        scale = torch.from_numpy(np.repeat(w[factored].astype(np.float32), [a.shape[1] for a in a_weights]))
        total = (A * scale) @ B
    shape = tuple(previous.shape)
    if total is not None and len(shape) == 4:  # folded once, so that the full-rank replies need no unrolling
        total = matrix_to_conv(total, shape[0], shape[1], shape[2])
    for i in full:  # one scaled add per full-rank reply (a stack and tensordot copy them all first: ~5× slower)
        weight = _float32(states[i][f"{name}.weight"])
        if total is None:
            total = weight * float(w[i])
        else:
            total.add_(weight, alpha=float(w[i]))
    if total is None:
        raise ValueError(f"no reply holds layer {name!r}")
    return total.to(previous.dtype).contiguous()


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32: itself when it is (a no-op ``.to`` is still a call, dozens a round)."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _without_factors(state: Mapping[str, torch.Tensor], ranks: Mapping[str, int]) -> State:
    """A hybrid state's keys other than the factor weights, ``L.a.bias`` renamed ``L.bias``."""
    return {new: state[key] for key, new in _kept_keys(tuple(state), tuple(ranks))}


@functools.lru_cache(maxsize=256)
def _kept_keys(keys: tuple[str, ...], layers: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``(key, name in the full state)`` of the keys :func:`_without_factors` keeps, for a hybrid
    state's keys and its factorized layers (worked out once per level: a round has a few)."""
    out = []
    for key in keys:
        layer, _, leaf = key.rpartition(".")
        owner = layer.rpartition(".")[0]
        if owner in layers and layer in (f"{owner}.a", f"{owner}.b"):
            if leaf == "bias":
                out.append((key, f"{owner}.bias"))
        elif layer not in layers or leaf != "weight":
            out.append((key, key))
    return tuple(out)


def classwise_average(
    previous: torch.Tensor, stacked: torch.Tensor, weights: torch.Tensor, holds: torch.Tensor
) -> torch.Tensor:
    """Average ``stacked`` (clients x classes x ...) per class over the clients holding it."""
    holds = holds.to(torch.float64)  # clients x classes
    if holds.shape != stacked.shape[:2]:
        raise ValueError(f"class_holds {tuple(holds.shape)} does not match rows {tuple(stacked.shape[:2])}")
    per_class = weights[:, None] * holds  # clients x classes
    total = per_class.sum(dim=0)  # classes
    held = total > 0
    norm = torch.where(held, per_class / total.clamp_min(1e-300), torch.zeros_like(per_class))
    trailing = (1,) * (stacked.dim() - 2)
    mixed = (norm.view(*norm.shape, *trailing) * stacked).sum(dim=0)
    keep = held.view(-1, *trailing)
    return torch.where(keep, mixed, previous.to(torch.float64)).to(previous.dtype)
