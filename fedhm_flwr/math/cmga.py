"""Cross-Model Gradient Alignment (HeteroTune's CMGA, docs/METHODS.md#heterotune-cmga): pure math, no Flower import.

The per-type averaged updates ``Δ_i`` of one share-adapter are stacked as the columns of
``G`` (``d × N``) and replaced by

    G̃ = c · G (GᵀG + εI)^(-1/2),

so that ``G̃ᵀG̃ = c² (GᵀG + εI)^(-1/2) GᵀG (GᵀG + εI)^(-1/2) → c² I`` as ``ε → 0`` (for ``G`` of
full column rank): the aligned updates are orthogonal and of equal length. ``G (GᵀG)^(-1/2)`` is
the orthogonal polar factor of ``G`` (the matrix with orthonormal columns nearest to ``G``).
By default ``c = ‖G‖_F / √N``, so ``‖G̃‖_F = ‖G‖_F`` (the total update size is kept) and for
``N = 1`` the update is unchanged (``G̃ = G``, FedAvg).

``ε`` is relative: the regulariser added is ``eps · trace(GᵀG) / N``, so that CMGA commutes with
scaling (``cmga(sG) = s · cmga(G)`` with the default ``c``) and tiny updates are not crushed by
an absolute constant. A zero ``G`` stays zero.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["cmga", "default_scale"]


def default_scale(G: Tensor) -> float:
    """``c = ‖G‖_F / √N`` (N = number of columns)."""
    return float(torch.linalg.norm(G.to(torch.float64))) / math.sqrt(G.shape[1])


def cmga(G: Tensor, c: float | None = None, eps: float = 1e-8) -> Tensor:
    """Aligned updates ``c · G (GᵀG + εI)^(-1/2)`` of ``G`` (``d × N``, one column per model type).

    Computed in float64 through the eigendecomposition of the small ``N × N`` Gram matrix;
    returned in ``G``'s dtype.
    """
    if G.ndim != 2 or G.shape[1] < 1:
        raise ValueError(f"G must be a (d, N) matrix with N >= 1, got shape {tuple(G.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    G64 = G.to(torch.float64)
    n = G64.shape[1]
    gram = G64.T @ G64
    scale = float(torch.trace(gram)) / n
    if scale == 0.0:
        return torch.zeros_like(G)
    c = default_scale(G64) if c is None else float(c)
    evals, evecs = torch.linalg.eigh(gram + eps * scale * torch.eye(n, dtype=torch.float64))
    floor = torch.finfo(torch.float64).tiny
    inv_sqrt = (evecs * evals.clamp_min(floor).rsqrt().unsqueeze(0)) @ evecs.T
    return (c * (G64 @ inv_sqrt)).to(G.dtype)
