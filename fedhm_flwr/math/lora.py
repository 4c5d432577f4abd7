"""FedLoRA math (docs/METHODS.md#fedlora, FedHM journal §5): hand out ``ΔW`` at a rank, aggregate the products.

Pure functions on tensors, no Flower import.

Conventions (docs/METHODS.md#fedlora): an adapted projection is ``W = W0 + B A`` (scale 1) with ``B`` of shape
``(out, r)`` and ``A`` of shape ``(r, in)``. The server keeps the full ``ΔW`` (``out × in``) of
every adapted projection.

* Hand-out (:func:`handout`): a client of rank ``r`` gets the best rank-``r`` approximation of
  ``ΔW`` (Eckart–Young), split as FedHM's spectral split (docs/METHODS.md#fedhm-factorization): with the thin SVD
  ``ΔW = U S Vᵀ``, ``B = U_r √S_r`` and ``A = √S_r V_rᵀ`` (:func:`fedhm_flwr.math.lowrank.split_factors`).
  A component whose singular value is ~0 (all of them in round 1, where ``ΔW = 0``) would give
  a zero row of ``A`` *and* a zero column of ``B``, and both gradients would then be zero
  forever; so its ``A`` row is replaced by a seeded random row and its ``B`` column is set to
  zero. ``B A`` is unchanged by that rule, so the hand-out error is exactly the discarded
  singular values: ``‖ΔW − B A‖_F² = Σ_{i>r} σ_i²`` and ``‖ΔW − B A‖_2 = σ_{r+1}``.
* Aggregation (:func:`aggregate_products`): ``ΔW ← Σ_p α_p B_p A_p`` with FedHM's weights
  (:func:`fedhm_flwr.math.aggregation.level_weights`). ``A`` and ``B`` are never averaged separately.
* Wire keys: a target layer ``L`` travels as ``L.lora_A`` / ``L.lora_B`` (client) and is kept as
  ``L.lora_delta`` (server, and the dense global model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from fedhm_flwr.math.lowrank import SVD, layer_svd, split_factors

__all__ = [
    "LORA_A",
    "LORA_B",
    "LORA_DELTA",
    "aggregate_products",
    "handout",
    "handout_state",
    "lora_rank",
    "lora_targets",
    "merge_lora_replies",
    "random_rows",
    "zero_components",
]

LORA_A, LORA_B, LORA_DELTA = "lora_A", "lora_B", "lora_delta"


def lora_rank(gamma: float, max_rank: int) -> int:
    """The LoRA rank of level ``gamma``: ``max(1, round(gamma · max_rank))`` (half up)."""
    if not 0 < gamma <= 1:
        raise ValueError(f"level ratio must be in (0, 1], got {gamma}")
    if max_rank < 1:
        raise ValueError(f"max_rank must be >= 1, got {max_rank}")
    return max(1, int(math.floor(gamma * max_rank + 0.5)))


def zero_components(S: Tensor, shape: tuple[int, int]) -> Tensor:
    """Boolean mask of singular values that count as zero.

    ``σ_i <= σ_max · max(shape) · eps(float32)`` (the rank tolerance of float32 data, since the
    weights travel as float32); every ``σ_i`` is zero when ``ΔW = 0``.
    """
    top = float(S.max()) if S.numel() else 0.0
    tol = top * max(shape) * float(torch.finfo(torch.float32).eps)
    return S <= tol


def random_rows(rows: int, in_features: int, generator: torch.Generator) -> Tensor:
    """Seeded start rows for ``A``: uniform in ``±1/√in`` (LoRA's Kaiming-uniform bound), float64."""
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rows, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def handout(delta: Tensor, rank: int, start_rows: Tensor, svd: SVD | None = None) -> tuple[Tensor, Tensor]:
    """``(A (r × in), B (out × r))``: the best rank-``r`` approximation of ``delta`` as ``B A``.

    ``start_rows`` (at least ``rank`` rows of length ``in``) gives the ``A`` row of every
    component whose singular value is ~0 (:func:`zero_components`); that component's ``B``
    column is zero. Pass the layer's ``svd`` to reuse one decomposition for every rank. float64.
    """
    if delta.ndim != 2:
        raise ValueError(f"ΔW must be a matrix, got shape {tuple(delta.shape)}")
    out_f, in_f = delta.shape
    if not 1 <= rank <= min(out_f, in_f):
        raise ValueError(f"rank must be in [1, {min(out_f, in_f)}] for ΔW {tuple(delta.shape)}, got {rank}")
    if start_rows.ndim != 2 or start_rows.shape[0] < rank or start_rows.shape[1] != in_f:
        raise ValueError(f"start_rows must be (>= {rank}, {in_f}), got {tuple(start_rows.shape)}")
    svd = svd if svd is not None else layer_svd(delta)
    B, A = split_factors(svd, rank)  # lowrank's (rows × r, r × cols) = LoRA's (B, A)
    zero = zero_components(svd.S[:rank], (out_f, in_f))
    if bool(zero.any()):
        A = A.clone()
        B = B.clone()
        A[zero] = start_rows[:rank][zero].to(A.dtype)
        B[:, zero] = 0.0
    return A, B


def lora_targets(state: Mapping[str, Tensor]) -> list[str]:
    """Layer names kept as ``ΔW`` in a (server) state: the keys ``<name>.lora_delta``."""
    suffix = "." + LORA_DELTA
    return sorted(k[: -len(suffix)] for k in state if k.endswith(suffix))


def handout_state(
    global_state: Mapping[str, Tensor],
    rank: int,
    start_rows: Mapping[str, Tensor],
    svds: Mapping[str, SVD] | None = None,
) -> dict[str, Tensor]:
    """A rank-``rank`` client's arrays: every ``L.lora_delta`` becomes ``L.lora_A``/``L.lora_B``
    (float32); every other key (the head) is passed through."""
    out: dict[str, Tensor] = {}
    targets = set(lora_targets(global_state))
    for key, value in global_state.items():
        name = key[: -len(LORA_DELTA) - 1] if key.endswith("." + LORA_DELTA) else None
        if name is None or name not in targets:
            out[key] = value
            continue
        A, B = handout(value, rank, start_rows[name], None if svds is None else svds.get(name))
        out[f"{name}.{LORA_A}"] = A.to(value.dtype).contiguous()
        out[f"{name}.{LORA_B}"] = B.to(value.dtype).contiguous()
    return out


def aggregate_products(pairs: Sequence[tuple[Tensor, Tensor]], weights: Sequence[float]) -> Tensor:
    """``Σ_p w_p B_p A_p`` over ``pairs = [(A_p, B_p), ...]`` (ranks may differ), float64."""
    if len(pairs) != len(weights) or not pairs:
        raise ValueError("need one weight per (A, B) pair, and at least one pair")
    total: Tensor | None = None
    for (A, B), w in zip(pairs, weights):
        if A.ndim != 2 or B.ndim != 2 or B.shape[1] != A.shape[0]:
            raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} do not form a product B A")
        term = float(w) * (B.to(torch.float64) @ A.to(torch.float64))
        total = term if total is None else total + term
    assert total is not None
    return total


def merge_lora_replies(
    global_state: Mapping[str, Tensor],
    replies: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float] | np.ndarray,
) -> dict[str, Tensor]:
    """New ``ΔW`` of every target: ``Σ_p α_p B_p A_p`` (other keys are not handled here)."""
    out: dict[str, Tensor] = {}
    for name in lora_targets(global_state):
        pairs = [(r[f"{name}.{LORA_A}"], r[f"{name}.{LORA_B}"]) for r in replies]
        prev = global_state[f"{name}.{LORA_DELTA}"]
        out[f"{name}.{LORA_DELTA}"] = aggregate_products(pairs, list(weights)).to(prev.dtype)
    return out
