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

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

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
    weights: Sequence[float],
    class_holds: np.ndarray | None = None,
    classifier_keys: Sequence[str] = (),
) -> State:
    """Weighted average of full-shape client states.

    ``class_holds`` is a (clients x classes) boolean matrix; when given, every tensor named in
    ``classifier_keys`` (its first dimension indexes classes) is averaged row by row over the
    clients holding that class, with their weights renormalised; rows of classes no client held
    keep ``previous``'s values. Keys missing from ``states`` keep ``previous``'s values.
    """
    if len(states) != len(weights) or not states:
        raise ValueError("need one weight per client state, and at least one state")
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    out: State = {}
    for key, prev in previous.items():
        if key not in states[0]:
            out[key] = prev.clone()
            continue
        stacked = torch.stack([s[key].to(torch.float64) for s in states])
        if class_holds is not None and key in classifier_keys:
            out[key] = classwise_average(prev, stacked, w, torch.as_tensor(class_holds))
        else:
            out[key] = torch.tensordot(w, stacked, dims=1).to(prev.dtype)
    return out


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
