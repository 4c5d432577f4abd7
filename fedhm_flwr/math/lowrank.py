"""Low-rank factorization of conv and linear layers (FedHM, docs/METHODS.md#fedhm-factorization).

Pure math on tensors, free of Flower and of any model: the server, the clients and the tests share
one implementation. The factorized layers built from these factors are in
:mod:`fedhm_flwr.models.layers`; which layers a model factorizes, and at which rank
(:func:`~fedhm_flwr.models.rules.plan_ranks`), is the rules module's.

Conventions
-----------
* A conv weight ``W`` has layout ``(n, m, k, k)`` = (out channels, in channels, kernel, kernel).
  It is *unrolled* into the matrix ``M`` of shape ``(n·k, m·k)`` whose rows index
  (out channel ``o``, kernel row ``i``) and whose columns index (in channel ``c``, kernel
  column ``j``): ``M[o*k + i, c*k + j] = W[o, c, i, j]``. A linear weight ``(out, in)`` is its
  own matrix.
* A rank-``r`` factorization is ``M ≈ A B`` with ``A`` (rows × r) and ``B`` (r × cols), from the
  truncated SVD with the singular values split evenly (spectral initialisation):
  ``A = U_r √S_r``, ``B = √S_r Vh_r``.
* A factorized conv is a ``1×k`` conv with ``r`` filters built from ``B`` followed by a ``k×1``
  conv with ``n`` filters built from ``A``; nothing in between. A factorized linear layer is
  ``Linear(in, r)`` (from ``B``) followed by ``Linear(r, out)`` (from ``A``).
* Hybrid state keys (the wire format): a factorized layer ``L`` with original keys ``L.weight``
  (and maybe ``L.bias``) is sent as ``L.b.weight``, ``L.a.weight`` (and ``L.a.bias``). Every
  other key is unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "SVD",
    "SVD_TOLERANCE",
    "WireFactors",
    "check_gamma",
    "compute_svds",
    "conv_a_weight",
    "conv_b_weight",
    "conv_to_matrix",
    "factor_matrices",
    "factorize_state",
    "factors_fit",
    "factors_frobenius_sq",
    "full_rank",
    "layer_matrix",
    "layer_svd",
    "matrix_to_conv",
    "rank_for",
    "recover_state",
    "split_factors",
    "truncation_backward_errors",
    "wire_factors",
]


# --------------------------------------------------------------------------------------------
# Unrolling
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _swap_index(shape: tuple[int, int, int, int]) -> Tensor:
    """The flat positions of ``x.permute(0, 2, 1, 3)`` in a contiguous ``x`` of ``shape`` (int32;
    one per shape: a model has a few dozen)."""
    return torch.arange(math.prod(shape), dtype=torch.int32).view(shape).permute(0, 2, 1, 3).reshape(-1)


def _swap_middle(x: Tensor) -> Tensor:
    """``x.permute(0, 2, 1, 3)`` of a 4-D tensor as a new contiguous tensor, the same values.

    On the CPU one ``index_select`` with a cached index (:func:`_swap_index`): torch's strided copy
    moves a kernel row (``k`` = 3 values) per step and takes 3–4× as long (measured: 169 µs against
    42 µs for the (128·3, 64·3) matrix of a 128 × 64 conv). Elsewhere, or under autograd, the copy.
    """
    a, b, c, d = x.shape
    if (
        x.device.type != "cpu" or x.requires_grad or not x.is_contiguous() or x.numel() >= 2**31 or b == 1 or c == 1
    ):  # (b or c = 1: nothing moves, the permuted view is contiguous)
        return x.permute(0, 2, 1, 3).contiguous()
    return x.reshape(-1).index_select(0, _swap_index((a, b, c, d))).view(a, c, b, d)


def conv_to_matrix(weight: Tensor) -> Tensor:
    """Unroll a conv weight ``(n, m, k, k)`` into the matrix ``(n·k, m·k)``.

    ``M[o*k + i, c*k + j] = W[o, c, i, j]``.
    """
    if weight.ndim != 4 or weight.shape[2] != weight.shape[3]:
        raise ValueError(f"expected a square-kernel conv weight (n, m, k, k), got {tuple(weight.shape)}")
    n, m, k, _ = weight.shape
    if k == 1:  # (a view)
        return weight.reshape(n, m)
    return _swap_middle(weight).reshape(n * k, m * k)


def matrix_to_conv(matrix: Tensor, n: int, m: int, k: int) -> Tensor:
    """Fold a matrix ``(n·k, m·k)`` back into a conv weight ``(n, m, k, k)`` (a new contiguous tensor).

    Exact inverse of :func:`conv_to_matrix`.
    """
    if tuple(matrix.shape) != (n * k, m * k):
        raise ValueError(f"expected a ({n * k}, {m * k}) matrix, got {tuple(matrix.shape)}")
    return _swap_middle(matrix.reshape(n, k, m, k))


def layer_matrix(weight: Tensor) -> Tensor:
    """The 2-D matrix of a layer weight: unrolled conv (4-D) or the linear weight itself (2-D)."""
    if weight.ndim == 4:
        return conv_to_matrix(weight)
    if weight.ndim == 2:
        return weight
    raise ValueError(f"cannot factorize a weight of shape {tuple(weight.shape)}")


def _fold(matrix: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Bring a layer matrix back to the layer's weight ``shape`` (inverse of :func:`layer_matrix`)."""
    if len(shape) == 4:
        n, m, k, _ = shape
        return matrix_to_conv(matrix, n, m, k)
    return matrix.reshape(shape)


def full_rank(shape: tuple[int, ...] | torch.Size) -> int:
    """Largest possible rank of the layer matrix: ``k·min(m, n)`` (conv) or ``min(out, in)``."""
    shape = tuple(shape)
    if len(shape) == 4:
        n, m, k, _ = shape
        return k * min(n, m)
    if len(shape) == 2:
        return min(shape)
    raise ValueError(f"cannot factorize a weight of shape {shape}")


# --------------------------------------------------------------------------------------------
# Rank rule and hybrid plan
# --------------------------------------------------------------------------------------------


def check_gamma(gamma: float) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
        raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}")
    gamma = float(gamma)
    if not (0.0 < gamma <= 1.0):  # also refuses NaN
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    return gamma


def _round_half_up(x: float) -> int:
    """``floor(x + 0.5)``: halves round up (Python's ``round`` would round 2.5 to 2).

    A tolerance of 1e-9 absorbs float noise in ratios such as 0.35 so that a product meant to be
    exactly ``k + 0.5`` still rounds up.
    """
    return math.floor(x + 0.5 + 1e-9)


def rank_for(shape: tuple[int, ...] | torch.Size, gamma: float) -> int:
    """Rank of a factorized layer of weight ``shape`` at rank ratio ``gamma`` (docs/METHODS.md#fedhm-ranks).

    Conv ``(n, m, k, k)``: ``max(1, round(gamma·n))``; linear ``(out, in)`` and 1×1 conv
    ``(n, m, 1, 1)`` (a linear map of the channels): ``max(1, round(gamma·min(out, in)))``;
    ``round`` is round-half-up; the result is capped at :func:`full_rank`. ``gamma`` must lie in
    ``(0, 1]``.
    """
    gamma = check_gamma(gamma)
    shape = tuple(shape)
    if len(shape) == 4:
        base = shape[0] if shape[2] > 1 else min(shape[:2])
    elif len(shape) == 2:
        base = min(shape)
    else:
        raise ValueError(f"cannot factorize a weight of shape {shape}")
    return min(full_rank(shape), max(1, _round_half_up(gamma * base)))


def factors_fit(shape: tuple[int, ...] | torch.Size, rank: int) -> bool:
    """Whether the rank-``rank`` factors of a layer of weight ``shape`` hold no more parameters
    than the layer itself: ``rank·(rows + cols) <= rows·cols`` for its ``(rows, cols)`` matrix
    (conv ``(n·k, m·k)``). A layer whose factors would be larger stays full at that level."""
    shape = tuple(shape)
    rows, cols = (shape[0] * shape[2], shape[1] * shape[3]) if len(shape) == 4 else shape
    return rank * (rows + cols) <= rows * cols


# --------------------------------------------------------------------------------------------
# SVD and factors
# --------------------------------------------------------------------------------------------


class SVD(NamedTuple):
    """Thin (possibly truncated) SVD ``M ≈ U diag(S) Vh`` of a layer matrix.

    The exact path keeps all ``min(rows, cols)`` components in float64; the fast path keeps the
    leading ``max(ranks)`` components, in float32 unless the float32 ones (refined once) fail the check of
    :func:`layer_svd` (see there).
    """

    U: Tensor
    S: Tensor
    Vh: Tensor


#: Default tolerance of the fast path (``method.svd_tolerance``): every truncation it hands out is
#: the exact truncated SVD of a weight within this relative Frobenius distance of the layer's
#: (:func:`truncation_backward_errors`, checked after the fact). Chosen by the measured experiment
#: in docs/METHODS.md#fedhm-svd-tolerance (``python -m bench.svd_tolerance``).
SVD_TOLERANCE = 1e-3


@functools.lru_cache(maxsize=64)
def _rank_masks(ranks: tuple[int, ...], k: int, dtype: torch.dtype) -> Tensor:
    """``len(ranks) × k²`` 0/1 masks in ``dtype``, row ``ρ`` the flattened ``k × k`` mask
    ``[i < r]·([j = i] + [j ≥ r])`` (``j`` the row, ``i`` the column, ``r = ranks[ρ]``): the kept
    columns' diagonal and their entries in the cut rows (one per ranks and size: a model has a few dozen)."""
    idx = torch.arange(k)
    j, i = idx.view(k, 1), idx.view(1, k)
    r = torch.tensor(ranks).view(-1, 1, 1)
    return ((i < r) & ((j == i) | (j >= r))).to(dtype).reshape(len(ranks), k * k)


def truncation_backward_errors(
    matrix: Tensor, Q: Tensor, C: Tensor, ranks: Iterable[int], total: float | None = None
) -> dict[int, float]:
    """A posteriori backward error of each rank-``r`` truncation ``Q_r Q_rᵀ M`` (``C = Q_kᵀ M``,
    ``k = Q``'s columns ≥ every rank; ``Q`` orthonormal, from the side of ``M``'s rows).

    The truncation is exactly the best rank-``r`` approximation of ``M − Δ``, where ``Δ`` removes
    from the discarded directions what couples them to the kept ones: with ``E = Q_{>r}ᵀ M Mᵀ Q_r``
    (the Gram residual of the kept subspace), ``‖Δ‖_F = ‖E diag(1/σ_i)‖_F``, ``σ_i = ‖C_i‖``. Returns
    ``{r: ‖Δ‖_F / ‖M‖_F}``: the part of ``E`` outside ``span(Q_k)`` from one residual ``M Cᵀ − Q_k C Cᵀ``
    (products with ``M`` itself, so that the Gram matrix's own rounding is seen), the part inside from
    the off-diagonal of ``C Cᵀ``. Needs no spectral gap: where the gap is small the float64 truncation is
    itself that sensitive to the weight, and the backward error is the honest measure.
    ``total``: ``‖M‖_F²`` when the caller has it (the Gram matrix's trace), else computed here.
    """
    if total is None:
        flat = (matrix.t() if matrix.t().is_contiguous() else matrix).reshape(-1)  # (a view of either side)
        total = float(torch.dot(flat, flat))
    return _backward_errors(matrix, Q, C, C @ C.t(), tuple(int(r) for r in ranks), total)


def _backward_errors(
    matrix: Tensor, Q: Tensor, C: Tensor, H: Tensor, ranks: tuple[int, ...], total: float
) -> dict[int, float]:
    """:func:`truncation_backward_errors` given ``H = C Cᵀ`` (``Q_kᵀ M Mᵀ Q_k``) and ``total = ‖M‖_F²``.

    Every rank at once: with ``D[j, i] = H[j, i]² / σ_i²`` off the diagonal and ``D[i, i] = o_i``,
    column ``i``'s part outside ``span(Q_k)`` over ``σ_i²``, rank ``r``'s ``‖Δ‖_F² = Σ_{i<r} (o_i +
    Σ_{j≥r} D[j, i])``: one product of the flattened ``D`` with the masks of :func:`_rank_masks`.
    """
    if total <= 0:
        return dict.fromkeys(ranks, 0.0)
    lam = H.diagonal().clamp_min(torch.finfo(H.dtype).tiny)
    # per kept column i: ‖(I − Q_k Q_kᵀ) M Mᵀ q_i‖² (the residual formed in place: no second k-wide temporary)
    outside = (matrix @ C.t()).addmm_(Q, H, alpha=-1).square().sum(dim=0)
    D = H.square().div_(lam)
    D.diagonal().copy_(outside.div_(lam))
    squares = _rank_masks(ranks, H.shape[0], H.dtype) @ D.view(-1)
    return {r: math.sqrt(value / total) for r, value in zip(ranks, squares.tolist())}


def _exact_svd(matrix: Tensor) -> SVD:
    U, S, Vh = torch.linalg.svd(matrix.to(torch.float64), full_matrices=False)
    return SVD(U, S, Vh)


def _gram_svd(
    matrix: Tensor, ranks: tuple[int, ...], dtype: torch.dtype, tolerance: float, refine: bool = False
) -> SVD | None:
    """Leading ``max(ranks)`` singular triplets from ``eigh`` of the smaller Gram matrix in ``dtype``,
    or None when :func:`truncation_backward_errors` exceeds ``tolerance`` at one of ``ranks``.

    With ``refine``, a result that fails the check gets one step of subspace iteration from its
    own eigenvectors (:func:`_subspace_step`) and the same check again before None. With ``Q`` the
    top eigenvectors, ``C = Qᵀ M`` (or ``M Q``); ``S`` is the row norms of ``C``, so
    ``U S Vh = Q Qᵀ M`` exactly whatever the accuracy of the eigenvalues, and both factors of
    :func:`split_factors` stay balanced. The components stay in the order the check accepted
    (decreasing eigenvalue of the Gram matrix; ``S`` decreases with it up to rounding between
    near-equal values): a rank-``r`` cut is then exactly the truncation that was checked.
    """
    M = matrix.to(dtype)
    wide = M.shape[0] <= M.shape[1]
    side = M if wide else M.t()  # rows × cols with rows <= cols: Q spans the rows' side
    gram = side @ side.t()
    total = float(gram.trace())  # ‖M‖_F²
    # eigh of −Gram: its ascending order is the Gram's descending one, so the top eigenvectors are
    # the leading columns (a view, no flip)
    _, Q = torch.linalg.eigh(gram.neg_())
    Q = Q[:, : max(ranks)]
    C = Q.t() @ side  # k × (other side)
    H = C @ C.t()
    if max(_backward_errors(side, Q, C, H, ranks, total).values()) > tolerance:
        if not refine:
            return None
        Q, C = _subspace_step(side, Q)
        H = C @ C.t()
        if max(_backward_errors(side, Q, C, H, ranks, total).values()) > tolerance:
            return None
    S = H.diagonal().sqrt()  # the row norms of C
    other = C / S.clamp_min(torch.finfo(dtype).tiny).unsqueeze(1)
    return SVD(Q, S, other) if wide else SVD(other.t(), S, Q.t())


def _subspace_step(side: Tensor, Q: Tensor) -> tuple[Tensor, Tensor]:
    """One step of subspace iteration from ``Q`` (rows × k, orthonormal): ``Q₁ = qr(M Mᵀ Q)``, then
    Rayleigh–Ritz in ``span(Q₁)`` (``eigh`` of the k × k ``C₁ C₁ᵀ``, ``C₁ = Q₁ᵀ M``); returns the
    rotated ``(Q₁ V, Vᵀ C₁)``, leading direction first.

    Why it helps where the Gram's ``eigh`` fails the check: the Gram matrix rounds its entries at
    ``u·σ₁²``, so directions with ``σᵢ`` below about ``√u·σ₁`` (3e-4 in float32) come out of it
    mixed with the discarded ones. The step multiplies every discarded component of the kept
    subspace by ``(σⱼ/σᵢ)²`` (the Gram never formed: ``Mᵀ Q`` first), and the Householder QR keeps
    each column's relative accuracy whatever its scale."""
    Q1, _ = torch.linalg.qr(side @ (side.t() @ Q))
    C1 = Q1.t() @ side
    _, V = torch.linalg.eigh((C1 @ C1.t()).neg_())  # (of −C₁C₁ᵀ: leading direction first)
    return Q1 @ V, V.t() @ C1


def layer_svd(weight: Tensor, ranks: Iterable[int] = (), tolerance: float = SVD_TOLERANCE) -> SVD:
    """SVD of the layer matrix of ``weight``, good for truncation at each of ``ranks``.

    Without ``ranks``, with a float64 weight, or when a rank equals the full rank (the
    truncation must then reproduce the layer): the exact path, a float64 full SVD. Otherwise
    ``eigh`` of the smaller Gram matrix in float32, checked after the fact: accepted when every
    truncation is the exact one of a weight within relative distance ``tolerance``
    (:func:`truncation_backward_errors`), else after one float32 step of subspace iteration from
    it (:func:`_subspace_step`, checked the same way), else ``eigh`` in float64, else the exact
    path. The fast paths return only the leading ``max(ranks)`` components.
    """
    if not (isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and tolerance > 0):
        raise ValueError(f"tolerance must be a number > 0, got {tolerance!r}")
    matrix = layer_matrix(weight.detach())
    wanted = tuple(sorted({int(r) for r in ranks}))
    full = min(matrix.shape)
    if wanted and not (1 <= wanted[0] and wanted[-1] <= full):
        raise ValueError(f"ranks must be in [1, {full}], got {list(wanted)}")
    if not wanted or wanted[-1] == full or matrix.dtype == torch.float64 or matrix.is_meta:
        return _exact_svd(matrix)  # (on the meta device: shapes only, nothing computed)
    for dtype in (torch.float32, torch.float64):
        svd = _gram_svd(matrix, wanted, dtype, tolerance, refine=dtype == torch.float32)
        if svd is not None:
            return svd
    return _exact_svd(matrix)


def compute_svds(
    full_state: Mapping[str, Tensor],
    names: Iterable[str],
    ranks: Mapping[str, Iterable[int]] | None = None,
    tolerance: float = SVD_TOLERANCE,
) -> dict[str, SVD]:
    """One :func:`layer_svd` per layer name (``name.weight`` in ``full_state``); ``ranks[name]``
    are the truncation ranks that layer will be cut at (none: the exact float64 SVD)."""
    ranks = ranks or {}
    return {name: layer_svd(full_state[f"{name}.weight"], ranks.get(name, ()), tolerance) for name in names}


def split_factors(svd: SVD, rank: int) -> tuple[Tensor, Tensor]:
    """Rank-``rank`` spectral factors ``A = U_r √S_r`` (rows × r), ``B = √S_r Vh_r`` (r × cols)."""
    if not (1 <= rank <= svd.S.numel()):
        raise ValueError(f"rank must be in [1, {svd.S.numel()}], got {rank}")
    root = svd.S[:rank].sqrt()
    A = svd.U[:, :rank] * root.unsqueeze(0)
    B = root.unsqueeze(1) * svd.Vh[:rank]
    return A, B


def factors_frobenius_sq(A: Tensor, B: Tensor) -> Tensor:
    """``‖A B‖_F²`` as ``sum((AᵀA) ⊙ (B Bᵀ))``: only r×r products, differentiable."""
    return ((A.t() @ A) * (B @ B.t())).sum()


def conv_b_weight(B: Tensor, m: int, k: int) -> Tensor:
    """``B (r, m·k)`` as the ``1×k`` conv weight ``(r, m, 1, k)``: ``B[t, c*k+j] -> w[t, c, 0, j]``."""
    return B.reshape(B.shape[0], m, 1, k)


def conv_a_weight(A: Tensor, n: int, k: int) -> Tensor:
    """``A (n·k, r)`` as the ``k×1`` conv weight ``(n, r, k, 1)``: ``A[o*k+i, t] -> w[o, t, i, 0]``."""
    return A.reshape(n, k, A.shape[1]).permute(0, 2, 1).unsqueeze(-1)


class WireFactors(NamedTuple):
    """A layer's spectral factors up to some rank ``R``, in the hybrid state's layout, contiguous:
    ``a`` is ``L.a.weight`` at rank ``R`` (conv ``(n, R, k, 1)``, linear ``(out, R)``), ``b`` is
    ``L.b.weight`` (conv ``(R, m, 1, k)``, linear ``(R, in)``). A rank-``r ≤ R`` cut is ``a[:, :r]``
    and ``b[:r]``: the same values as :func:`split_factors` at ``r`` (elementwise products, so a
    component's factors do not depend on how many are kept)."""

    a: Tensor
    b: Tensor


def wire_factors(svd: SVD, shape: tuple[int, ...] | torch.Size, rank: int | None = None) -> WireFactors:
    """:class:`WireFactors` of a layer of weight ``shape`` from its SVD, up to ``rank`` (default:
    every component the SVD has): made once, cut at each level's rank by :func:`factorize_state`."""
    A, B = split_factors(svd, svd.S.numel() if rank is None else rank)
    if len(shape) == 4:
        n, m, k, _ = shape
        A, B = conv_a_weight(A, n, k), conv_b_weight(B, m, k)
    return WireFactors(A.contiguous(), B.contiguous())


# --------------------------------------------------------------------------------------------
# State dicts (the server side: no model needed)
# --------------------------------------------------------------------------------------------


def _as_wire(t: Tensor) -> Tensor:
    """Detached, contiguous; floating tensors as float32 (the tensor itself when it is all that
    already: the array cache then knows it by identity)."""
    if not t.requires_grad and t.dtype == torch.float32 and t.is_contiguous():
        return t
    t = t.detach()
    if t.is_floating_point():
        t = t.to(torch.float32)
    return t.contiguous()


def factorize_state(
    full_state: Mapping[str, Tensor],
    ranks: Mapping[str, int],
    svds: Mapping[str, SVD] | None = None,
    factors: Mapping[str, WireFactors] | None = None,
) -> dict[str, Tensor]:
    """Hybrid state dict of a full state dict: layer ``L`` in ``ranks`` becomes ``L.b.weight``,
    ``L.a.weight`` (and ``L.a.bias``), spectral factors at rank ``ranks[L]``.

    Pass ``svds`` (from :func:`compute_svds`) to share one SVD per layer across levels, or
    ``factors`` (:func:`wire_factors`, up to at least the rank) to share the factors too: a level's
    ``L.b.weight`` is then a view of them (its leading rows), its ``L.a.weight`` one copy of its
    leading columns. Key order follows ``full_state`` and matches ``state_dict()`` of the hybrid
    model. Floating tensors come out float32 and contiguous.
    """
    missing = [f"{name}.weight" for name in ranks if f"{name}.weight" not in full_state]
    if missing:
        raise KeyError(f"full state lacks {missing}")
    out: dict[str, Tensor] = {}
    for key, value in full_state.items():
        layer, _, leaf = key.rpartition(".")
        if layer not in ranks:
            out[key] = _as_wire(value)
        elif leaf == "weight":
            rank = int(ranks[layer])
            held = factors.get(layer) if factors is not None else None
            if held is None:
                svd = svds[layer] if svds is not None and layer in svds else layer_svd(value)
                held = wire_factors(svd, value.shape, rank)
            elif not 1 <= rank <= held.b.shape[0]:
                raise ValueError(f"rank must be in [1, {held.b.shape[0]}], got {rank}")
            out[f"{layer}.b.weight"] = _as_wire(held.b[:rank])
            out[f"{layer}.a.weight"] = _as_wire(held.a[:, :rank])
        elif leaf == "bias":
            out[f"{layer}.a.bias"] = _as_wire(value)
        else:
            raise ValueError(f"unexpected key {key!r} in a layer to factorize")
    return out


def factor_matrices(a_weight: Tensor, b_weight: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """``(A, B, full weight shape)`` from the wire tensors of one factorized layer."""
    if a_weight.ndim == 4:
        n, r, k, _ = a_weight.shape
        m = b_weight.shape[1]
        A = a_weight.squeeze(-1).permute(0, 2, 1).reshape(n * k, r)
        B = b_weight.reshape(b_weight.shape[0], m * k)
        return A, B, (n, m, k, k)
    return a_weight, b_weight, (a_weight.shape[0], b_weight.shape[1])


def recover_state(hybrid_state: Mapping[str, Tensor], ranks: Mapping[str, int]) -> dict[str, Tensor]:
    """Full-shape state dict of a hybrid one (model shape alignment, journal eq. 1).

    ``L.weight = A B`` folded back (product taken in float64, returned in the factors' dtype),
    ``L.a.bias -> L.bias``; other keys as they are. Key order follows ``hybrid_state``.
    """
    out: dict[str, Tensor] = {}
    for key, value in hybrid_state.items():
        layer, _, leaf = key.rpartition(".")
        owner = layer.rpartition(".")[0]
        if owner in ranks and layer.endswith((".a", ".b")) and leaf in ("weight", "bias"):
            if key == f"{owner}.b.weight":
                a_weight = hybrid_state.get(f"{owner}.a.weight")
                if a_weight is None:
                    raise KeyError(f"hybrid state lacks {owner}.a.weight")
                A, B, shape = factor_matrices(a_weight, value)
                if A.shape[1] != int(ranks[owner]) or B.shape[0] != int(ranks[owner]):
                    raise ValueError(f"layer {owner!r}: factors have rank {A.shape[1]}, expected {ranks[owner]}")
                product = A.to(torch.float64) @ B.to(torch.float64)
                out[f"{owner}.weight"] = _fold(product, shape).to(a_weight.dtype).contiguous()
            elif key == f"{owner}.a.bias":
                out[f"{owner}.bias"] = value
            elif key != f"{owner}.a.weight":
                raise ValueError(f"unexpected key {key!r} in a factorized layer")
        else:
            out[key] = value
    missing = [name for name in ranks if f"{name}.weight" not in out]
    if missing:
        raise KeyError(f"hybrid state lacks the factors of {missing}")
    return out
