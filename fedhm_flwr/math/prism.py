"""PriSM: probabilistic sub-models in the orthogonal kernel space (docs/METHODS.md#prism). No Flower import.

Conventions
-----------
* A conv weight ``W (n, m, k, k)`` is unrolled into ``W̄ (n, m·k·k)`` (im2col, the paper's
  unrolling; **not** FedHM's ``(n·k, m·k)``): ``W̄[o, :] = W[o].flatten()``. A linear weight
  ``(out, in)`` is its own matrix. ``R = min(rows, cols)`` principal kernels.
* The server keeps ``W̄ = U diag(σ) Vh`` (thin SVD, float64: :class:`Factored`). Kernel ``i`` is
  ``σ_i u_i v_iᵀ``; as trainable factors it is ``u'_i = √σ_i u_i`` and ``v'_i = √σ_i v_i``
  (σ folded in, the paper's section 3.2.2).
* A client's sub-layer with kernels ``I`` (``r = |I|``) is two layers and nothing between them:
  ``v``, a ``k×k`` conv with ``r`` filters (the rows ``v'_I`` folded to ``(r, m, k, k)``, the
  original stride and padding, no bias), then ``u``, a ``1×1`` conv with ``n`` filters (``U'_I``
  as ``(n, r, 1, 1)``). Its output is ``Σ_{i∈I} σ_i u_i v_iᵀ X̄`` (paper eq. 3); with every kernel
  it is the original layer's output. Linear: ``v = Linear(in, r)``, ``u = Linear(r, out)``. A
  layer bias stays one full-length parameter ``bias`` added after ``u`` (key ``L.bias``, as in the
  full model), aggregated like any unfactorized parameter.
* **U-subset** (the memory option, paper section 3.2.1): ``u`` computes only the output channels
  ``J`` (``rows``): its weight is ``U'_I[J]``; the other channels of the layer's output are zero
  on the client. The rows of ``U'`` not computed (``û``) stay on the server and are put back in
  aggregation (paper eq. 5). The server-side layer (its weight, shape and factored form) is the
  same with or without the option.
* Wire keys of a sampled layer ``L``: ``L.v.weight``, ``L.u.weight`` (and ``L.bias``). The kernel
  indices ``I`` never travel: the client only needs ``r`` (and ``J`` with the U-subset).

Functions: :func:`decompose` / :func:`compose` (the factored form and back), :func:`keep_count`
(``ceil(keep·R)``), :func:`sampling_probabilities` (``p ∝ σ^κ``, uniform, softmax(σ)),
:func:`draw` (sampling without replacement, seeded generator; OrthDrop's top-k),
:func:`slice_layer` (a client's factors), :func:`aggregate_kernels` (per-kernel means,
unsampled kernels and uncomputed rows unchanged), :func:`refresh` (re-decomposition). The
sampled sub-layers a client trains are :class:`fedhm_flwr.models.layers.PrismConv2d` /
``PrismLinear``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "SAMPLINGS",
    "Draw",
    "Factored",
    "aggregate_kernels",
    "compose",
    "decompose",
    "draw",
    "fold",
    "keep_count",
    "layer_spec",
    "num_kernels",
    "refresh",
    "reply_factors",
    "sampling_probabilities",
    "scaled_factors",
    "slice_layer",
    "unroll",
]

#: kernel selection rules: PriSM's p ∝ σ^κ, OrthDrop's deterministic top-k, and the paper's
#: ablations (Table 5): uniform, softmax of σ
SAMPLINGS = ("prism", "orthdrop", "uniform", "softmax")


# --------------------------------------------------------------------------------------------
# Unrolling and the factored form
# --------------------------------------------------------------------------------------------


def unroll(weight: Tensor) -> Tensor:
    """The layer matrix: a conv weight ``(n, m, k, k)`` as ``(n, m·k·k)``; a linear weight as is."""
    if weight.ndim == 4:
        return weight.reshape(weight.shape[0], -1)
    if weight.ndim == 2:
        return weight
    raise ValueError(f"cannot decompose a weight of shape {tuple(weight.shape)}")


def fold(matrix: Tensor, shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`unroll`: the matrix back in the layer's weight ``shape``."""
    shape = tuple(int(s) for s in shape)
    if matrix.shape != (shape[0], math.prod(shape[1:])):
        raise ValueError(f"a ({shape[0]}, {math.prod(shape[1:])}) matrix folds into {shape}, got {tuple(matrix.shape)}")
    return matrix.reshape(shape).contiguous()


def num_kernels(shape: Sequence[int]) -> int:
    """``R = min(n, m·k·k)`` (conv) or ``min(out, in)`` (linear)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (2, 4):
        raise ValueError(f"cannot decompose a weight of shape {shape}")
    return min(shape[0], math.prod(shape[1:]))


class Factored(NamedTuple):
    """``W̄ = U diag(S) Vh`` of one layer (float64), ``shape`` = the layer's weight shape."""

    U: Tensor  # (n, R), orthonormal columns
    S: Tensor  # (R,), descending, >= 0
    Vh: Tensor  # (R, cols), orthonormal rows
    shape: tuple[int, ...]


def decompose(weight: Tensor) -> Factored:
    """Thin SVD of the unrolled weight, in float64 (the factored full-rank form)."""
    matrix = unroll(weight.detach()).to(torch.float64)
    U, S, Vh = torch.linalg.svd(matrix, full_matrices=False)
    return Factored(U, S, Vh, tuple(weight.shape))


def compose(factored: Factored) -> Tensor:
    """``U diag(S) Vh`` folded to the layer's shape (float64)."""
    return fold((factored.U * factored.S) @ factored.Vh, factored.shape)


def scaled_factors(factored: Factored) -> tuple[Tensor, Tensor]:
    """``(U', V') = (U √S, √S Vh)``: column ``i`` of ``U'`` is ``u'_i``, row ``i`` of ``V'`` is ``v'_i``."""
    root = factored.S.clamp_min(0).sqrt()
    return factored.U * root, root[:, None] * factored.Vh


def refresh(U: Tensor, V: Tensor, shape: Sequence[int]) -> Factored:
    """Orthogonal space refresh: the SVD of ``U V`` (any factors, e.g. after aggregation)."""
    return decompose(fold(U.to(torch.float64) @ V.to(torch.float64), shape))


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def keep_count(R: int, keep: float) -> int:
    """``ceil(keep·R)`` kernels (at least 1, at most ``R``); float noise such as ``0.7·10`` is
    absorbed (a product within 1e-9 of an integer counts as that integer)."""
    if not (0.0 < float(keep) <= 1.0):
        raise ValueError(f"keep ratio must be in (0, 1], got {keep!r}")
    return min(int(R), max(1, math.ceil(float(keep) * int(R) - 1e-9)))


def sampling_probabilities(S: Tensor | np.ndarray, sampling: str, kappa: float = 1.0) -> np.ndarray:
    """Probabilities of the ``R`` kernels (float64, summing to 1).

    ``prism``: ``p_i ∝ σ_i^κ`` (paper eq. 2); ``uniform``: ``1/R``; ``softmax``: ``p = softmax(σ)``.
    ``orthdrop`` has no probabilities (top-k): ``None`` is not returned, a ValueError is raised.
    When every ``σ_i^κ`` is 0 (an all-zero layer) the kernels are equally likely.
    """
    s = np.asarray(S.detach().cpu() if isinstance(S, Tensor) else S, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or np.any(~np.isfinite(s)) or np.any(s < 0):
        raise ValueError("singular values must be a non-empty vector of finite non-negative numbers")
    if sampling == "prism":
        if kappa < 0:
            raise ValueError(f"kappa must be >= 0, got {kappa}")
        top = s.max()
        w = (s / top) ** float(kappa) if top > 0 else np.zeros_like(s)  # scaled: no overflow
    elif sampling == "uniform":
        w = np.ones_like(s)
    elif sampling == "softmax":
        w = np.exp(s - s.max())
    else:
        raise ValueError(f"sampling {sampling!r} has no probabilities; allowed: prism, uniform, softmax")
    total = w.sum()
    if not total > 0:
        return np.full_like(s, 1.0 / s.size)
    return w / total


class Draw(NamedTuple):
    """The kernels (sorted indices into ``0..R-1``) and, with the U-subset, the output rows
    (sorted indices into ``0..n-1``; ``None`` = all rows) of one client's sub-layer."""

    kernels: Tensor
    rows: Tensor | None = None


def draw(
    R: int, count: int, sampling: str, rng: np.random.Generator | None = None, probabilities: np.ndarray | None = None
) -> Tensor:
    """``count`` distinct kernel indices, sorted.

    ``orthdrop``: the top ``count`` (``0..count-1``; the SVD sorts σ descending), no randomness.
    Otherwise sampling without replacement from ``probabilities`` (successive sampling: each draw
    proportional to the probabilities of the kernels not drawn yet; numpy's
    ``Generator.choice(replace=False, p=...)``). Kernels of probability 0 are drawn (uniformly)
    only when fewer than ``count`` kernels have a positive probability.
    """
    if not 1 <= count <= R:
        raise ValueError(f"count must be in [1, {R}], got {count}")
    if sampling == "orthdrop":
        return torch.arange(count, dtype=torch.long)
    if rng is None or probabilities is None:
        raise ValueError(f"sampling {sampling!r} needs a generator and probabilities")
    p = np.asarray(probabilities, dtype=np.float64)
    if p.shape != (R,):
        raise ValueError(f"need {R} probabilities, got shape {p.shape}")
    positive = np.flatnonzero(p > 0)
    if positive.size >= count:
        picked = rng.choice(R, size=count, replace=False, p=p / p.sum())
    else:  # all the positive ones, the rest uniformly among the zeros
        zeros = np.flatnonzero(p <= 0)
        picked = np.concatenate([positive, rng.choice(zeros, size=count - positive.size, replace=False)])
    return torch.as_tensor(np.sort(picked), dtype=torch.long)


# --------------------------------------------------------------------------------------------
# A client's factors and their aggregation
# --------------------------------------------------------------------------------------------


def slice_layer(factored: Factored, sample: Draw) -> tuple[Tensor, Tensor]:
    """A client's factors of one layer as wire tensors (float32): ``(u weight, v weight)``.

    ``v``: ``v'_I`` as ``(r, m, k, k)`` (conv) or ``(r, in)``; ``u``: ``U'_I`` (rows ``J`` with the
    U-subset) as ``(|J|, r, 1, 1)`` (conv) or ``(|J|, r)``.
    """
    U, V = scaled_factors(factored)
    index = sample.kernels
    Uq, Vq = U[:, index], V[index]
    if sample.rows is not None:
        Uq = Uq[sample.rows]
    shape = factored.shape
    if len(shape) == 4:
        v = Vq.reshape(len(index), *shape[1:])
        u = Uq.reshape(Uq.shape[0], len(index), 1, 1)
    else:
        v, u = Vq, Uq
    return u.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()


def reply_factors(u_weight: Tensor, v_weight: Tensor) -> tuple[Tensor, Tensor]:
    """The matrices ``(U'_I[J] (|J|, r), V'_I (r, cols))`` of a client's wire tensors."""
    r = v_weight.shape[0]
    return u_weight.reshape(u_weight.shape[0], r), v_weight.reshape(r, -1)


def aggregate_kernels(factored: Factored, replies: Sequence[tuple[Draw, Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Per-kernel aggregation (paper eq. 5, ``α_i^c = 1/C_i``): the new ``(U', V')`` (float64).

    ``replies`` holds, per client, its draw and its trained ``U'_I[J] (|J|, r)``, ``V'_I (r, cols)``.
    ``v'_i`` becomes the mean over the clients that sampled kernel ``i``; element ``(j, i)`` of
    ``U'`` the mean over the clients that sampled ``i`` and computed row ``j``. Kernels nobody
    sampled, and rows nobody computed (``û``), keep the server's values. ``U' V'`` is the new
    layer matrix (re-decompose it with :func:`refresh`).
    """
    U0, V0 = scaled_factors(factored)
    n, R = U0.shape
    u_sum, u_cnt = torch.zeros_like(U0), torch.zeros_like(U0)
    v_sum, v_cnt = torch.zeros_like(V0), torch.zeros(R, dtype=V0.dtype)
    for sample, Uq, Vq in replies:
        kernels = sample.kernels
        rows = sample.rows if sample.rows is not None else torch.arange(n)
        if Vq.shape != (len(kernels), V0.shape[1]) or Uq.shape != (len(rows), len(kernels)):
            raise ValueError(
                f"reply factors {tuple(Uq.shape)}, {tuple(Vq.shape)} do not match the draw "
                f"({len(rows)} rows, {len(kernels)} kernels)"
            )
        v_sum.index_add_(0, kernels, Vq.to(V0.dtype))
        v_cnt.index_add_(0, kernels, torch.ones(len(kernels), dtype=V0.dtype))
        grid = (rows[:, None].expand(-1, len(kernels)), kernels[None, :].expand(len(rows), -1))
        u_sum.index_put_(grid, Uq.to(U0.dtype), accumulate=True)
        u_cnt.index_put_(grid, torch.ones_like(Uq, dtype=U0.dtype), accumulate=True)
    V = torch.where(v_cnt[:, None] > 0, v_sum / v_cnt.clamp_min(1)[:, None], V0)
    U = torch.where(u_cnt > 0, u_sum / u_cnt.clamp_min(1), U0)
    return U, V


# --------------------------------------------------------------------------------------------
# The client's sub-layers (the layers themselves: fedhm_flwr.models.layers.PrismConv2d / PrismLinear)
# --------------------------------------------------------------------------------------------


def layer_spec(sample: Draw) -> dict[str, Any]:
    """What the model spec says of one sampled layer: its rank (and the computed rows)."""
    out: dict[str, Any] = {"rank": int(sample.kernels.numel())}
    if sample.rows is not None:
        out["rows"] = [int(j) for j in sample.rows]
    return out
