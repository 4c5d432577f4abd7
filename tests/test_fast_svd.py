"""FedHM's fast decomposition (docs/METHODS.md#fedhm-svd-tolerance): the float32 Gram SVD, its
a-posteriori backward-error check, the subspace step, the fallbacks, and the levels cut from one
set of factors."""

from __future__ import annotations

import math

import pytest
import torch

from fedhm_flwr.math.lowrank import (
    SVD_TOLERANCE,
    _gram_svd,
    _subspace_step,
    factorize_state,
    full_rank,
    layer_svd,
    recover_state,
    split_factors,
    truncation_backward_errors,
    wire_factors,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- fast decomposition (bound, fallback, exactness)


def _with_spectrum(rows: int, cols: int, sigma: torch.Tensor) -> torch.Tensor:
    """A float32 matrix with the given singular values (random singular vectors)."""
    U, _ = torch.linalg.qr(torch.randn(rows, sigma.numel(), dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, sigma.numel(), dtype=torch.float64))
    return ((U * sigma) @ V.t()).float()


def _truncation_error(M: torch.Tensor, svd, r: int) -> float:
    """Relative Frobenius error of the rank-r product against the float64 SVD's."""
    U, S, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    ref = (U[:, :r] * S[:r]) @ Vh[:r]
    A, B = split_factors(svd, r)
    return (torch.linalg.norm(A.double() @ B.double() - ref) / torch.linalg.norm(ref)).item()


def _backward_error(M: torch.Tensor, svd, r: int) -> float:
    """Relative size of the smallest perturbation ``D`` for which the rank-r product is exactly the
    truncated SVD of ``M - D`` (float64, from an independent orthogonal complement of ``U_r``):
    ``‖Q_⊥ᵀ M Mᵀ U_r diag(1/s)‖_F / ‖M‖_F`` with ``U_r`` orthonormalised."""
    A, B = split_factors(svd, r)
    M64, T = M.double(), A.double() @ B.double()
    U = torch.linalg.qr(T if T.shape[0] <= T.shape[1] else T.t())[0][:, :r]  # the product's row side
    side = M64 if T.shape[0] <= T.shape[1] else M64.t()
    full = torch.linalg.qr(torch.cat([U, torch.randn(U.shape[0], U.shape[0] - r, dtype=torch.float64)], 1))[0]
    perp = full[:, r:]
    coupling = perp.t() @ side @ side.t() @ U  # (rows - r) × r
    s = torch.linalg.svdvals(U.t() @ side)
    return (torch.linalg.norm(coupling @ torch.diag(1 / s)) / torch.linalg.norm(M64)).item()


def _excess_error(M: torch.Tensor, svd, r: int) -> float:
    """‖M − A_r B_r‖_F − ‖M − M_r‖_F relative to ‖M‖_F (gap-free: how much worse than the best)."""
    A, B = split_factors(svd, r)
    M64 = M.double()
    sigma = torch.linalg.svdvals(M64)
    best = sigma[r:].square().sum().sqrt()
    return ((torch.linalg.norm(M64 - A.double() @ B.double()) - best) / torch.linalg.norm(M64)).item()


@pytest.mark.parametrize("rows,cols", [(192, 96), (96, 288), (150, 150)])
@pytest.mark.parametrize(
    "spectrum,gammas,fast",
    [
        ("gaussian", (1 / 16, 1 / 24, 1 / 32), True),  # a freshly initialised layer: float32 eigh of the Gram
        ("gaussian", (1 / 2, 1 / 4, 1 / 8), True),  # flat spectrum, small gaps: float32 all the same
        ("power", (1 / 2, 1 / 4, 1 / 8), True),  # sigma_i = i^-1/2: small gaps deep in the spectrum
        # singular values spanning 1 .. 1e-8: the Gram's eigh cannot cut there, one float32 subspace step can
        ("log", (1 / 2, 1 / 4, 1 / 8), True),
    ],
)
def test_fast_svd_meets_the_tolerance_at_every_level_rank(rows, cols, spectrum, gammas, fast):
    k = min(rows, cols)
    if spectrum == "gaussian":
        M = torch.randn(rows, cols) * 0.05
    elif spectrum == "power":
        M = _with_spectrum(rows, cols, torch.arange(1, k + 1, dtype=torch.float64) ** -0.5)
    else:
        M = _with_spectrum(rows, cols, torch.logspace(0, -8, k, dtype=torch.float64))
    ranks = [max(1, round(g * k)) for g in gammas]  # a linear layer's gamma*min(out, in)
    svd = layer_svd(M, ranks)
    assert svd.S.numel() == max(ranks)  # only the leading components are computed
    assert (svd.S.dtype == torch.float32) is fast  # which path the a-posteriori check chose
    for r in ranks:
        assert _backward_error(M, svd, r) <= SVD_TOLERANCE, (spectrum, r)
        assert _excess_error(M, svd, r) <= 2 * SVD_TOLERANCE, (spectrum, r)
        if spectrum != "log":  # the float32 rounding of the weight itself is 6e-8
            assert _backward_error(M, svd, r) <= 1e-5, (spectrum, r)


def _mixed_subspace(rows: int, cols: int, k: int, eps: float, dtype: torch.dtype):
    """(rows' side of M, Q, C = Qᵀ side): ``Q`` the leading ``k`` eigenvectors of the Gram matrix
    mixed with the discarded ones by ``eps`` and orthonormalised, so that the backward error grows
    with the rank (singular values 1 .. 1e-3)."""
    M = _with_spectrum(rows, cols, torch.logspace(0, -3, min(rows, cols), dtype=torch.float64)).double()
    side = M if rows <= cols else M.t()
    exact = torch.linalg.eigh(side @ side.t())[1].flip(1)[:, :k]
    Q = torch.linalg.qr(exact + eps * torch.randn(side.shape[0], k, dtype=torch.float64))[0]
    side, Q = side.to(dtype), Q.to(dtype)
    return side, Q, Q.t() @ side


@pytest.mark.parametrize("rows,cols", [(40, 90), (90, 40)])
def test_backward_errors_of_every_rank_match_their_definition(rows, cols):
    """All ranks at once (float64) equal, rank by rank, the definition ‖(I − Q_r Q_rᵀ) M Mᵀ Q_r
    diag(1/σ_i)‖_F / ‖M‖_F, σ_i = ‖q_iᵀ M‖; some of these ranks fail a tolerance, some pass."""
    side, Q, C = _mixed_subspace(rows, cols, 24, 1e-6, torch.float64)
    ranks = (1, 5, 12, 24)  # 24 = every column of Q: no kept-but-cut part
    got = truncation_backward_errors(side, Q, C, ranks)
    G = side @ side.t()
    for r in ranks:
        Qr = Q[:, :r]
        E = G @ Qr - Qr @ (Qr.t() @ G @ Qr)
        sigma2 = (Qr.t() @ side).square().sum(dim=1)
        want = math.sqrt(float((E.square().sum(dim=0) / sigma2).sum()) / float(side.square().sum()))
        assert got[r] == pytest.approx(want, rel=1e-9), r
    tolerance = math.sqrt(min(got.values()) * max(got.values()))  # between the best and the worst rank
    assert min(got.values()) < tolerance < max(got.values())  # some ranks must be rejected there, some not


def _backward_errors_rank_by_rank(matrix, Q, C, ranks):
    """The check one rank at a time in the working dtype: outside part per kept column, couplings
    to the kept-but-cut columns from C Cᵀ (the per-rank loop the all-ranks form replaces)."""
    H = C @ C.t()
    outside = (matrix @ C.t() - Q @ H).square().sum(dim=0)
    lam = H.diagonal()
    total = float(matrix.square().sum())
    return {r: math.sqrt(float(((outside[:r] + H[r:, :r].square().sum(dim=0)) / lam[:r]).sum()) / total) for r in ranks}


@pytest.mark.parametrize("rows,cols", [(96, 192), (192, 96), (64, 64)])
def test_backward_errors_in_float32_are_the_rank_by_rank_ones(rows, cols):
    """In float32 the all-ranks form gives the rank-by-rank values up to float32 rounding (far
    below any tolerance's margin), and the same accept/reject at a tolerance between the ranks."""
    side, Q, C = _mixed_subspace(rows, cols, 32, 1e-4, torch.float32)
    ranks = (4, 8, 16, 32)
    got, want = truncation_backward_errors(side, Q, C, ranks), _backward_errors_rank_by_rank(side, Q, C, ranks)
    for r in ranks:
        assert got[r] == pytest.approx(want[r], rel=1e-5), r
    tolerance = math.sqrt(min(want.values()) * max(want.values()))  # some ranks fail it, some pass
    assert [got[r] > tolerance for r in ranks] == [want[r] > tolerance for r in ranks]
    assert 0 < sum(got[r] > tolerance for r in ranks) < len(ranks)
    assert truncation_backward_errors(torch.zeros_like(side), Q, C, ranks) == dict.fromkeys(ranks, 0.0)


def test_subspace_step_repairs_what_the_gram_cannot_resolve():
    """Singular values spanning 1 .. 1e-8: the float32 Gram rounds away the directions below
    √u·σ₁, so its cut at the top rank fails a tolerance of 1e-4 (about 1.6e-4: the default 1e-3
    lets it through); one float32 step of subspace iteration from it passes the same check, and the
    layer stays float32 with its truncations within the tolerance by an independent measure."""
    torch.manual_seed(3)
    tight = 1e-4
    M = _with_spectrum(192, 96, torch.logspace(0, -8, 96, dtype=torch.float64))
    ranks = (12, 24, 48)
    assert _gram_svd(M, ranks, torch.float32, tight) is None  # the Gram's eigh alone fails
    assert _gram_svd(M, ranks, torch.float32, SVD_TOLERANCE) is not None  # (the default passes it)
    refined = _gram_svd(M, ranks, torch.float32, tight, refine=True)
    assert refined is not None and refined.S.dtype == torch.float32
    side = M.t()  # (96 × 192: the rows' side)
    Q, C = _subspace_step(side, torch.linalg.eigh(side @ side.t())[1][:, -48:].flip(1))
    torch.testing.assert_close(Q.t() @ Q, torch.eye(48), atol=1e-5, rtol=0)  # still orthonormal
    # leading direction first, up to what a float32 eigh of C Cᵀ resolves (σ² within ~u·σ₁²;
    # the order of two directions closer than that changes with the thread count)
    energy = C.norm(dim=1) ** 2
    assert bool((energy[:-1] >= energy[1:] - 1e-6 * energy[0]).all())
    svd = layer_svd(M, ranks, tolerance=tight)
    assert svd.S.dtype == torch.float32
    for r in ranks:
        assert _backward_error(M, svd, r) <= tight


def test_fast_svd_tolerance_decides_the_path_and_is_met():
    """A tight tolerance sends the same layer to float64 (and then the exact SVD), a loose one keeps
    float32; each result meets its own tolerance."""
    M = _with_spectrum(150, 150, torch.logspace(0, -8, 150, dtype=torch.float64))
    ranks = [19, 38, 75]
    loose = layer_svd(M, ranks, tolerance=1e-2)
    tight = layer_svd(M, ranks, tolerance=1e-6)
    exact = layer_svd(M, ranks, tolerance=1e-300)
    assert loose.S.dtype == torch.float32 and tight.S.dtype == torch.float64 and tight.S.numel() == 75
    assert exact.S.dtype == torch.float64 and exact.S.numel() == 150  # the full float64 SVD
    for r in ranks:
        assert _backward_error(M, loose, r) <= 1e-2
        assert _backward_error(M, tight, r) <= 1e-6
    with pytest.raises(ValueError, match="tolerance must be a number > 0"):
        layer_svd(M, ranks, tolerance=0.0)


@pytest.mark.parametrize("exact", [False, True])
def test_levels_cut_from_shared_wire_factors_equal_their_own_factorization(exact):
    """Factors made once up to the top rank (:func:`wire_factors`) and cut per level give every
    level's hybrid state bit for bit as factorizing it alone (conv and linear, float32 and float64
    SVD): the same keys, order, shapes, contiguous float32 tensors; a rank beyond them is refused."""
    state = {
        "c.weight": torch.randn(32, 16, 3, 3),
        "c.bias": torch.randn(32),
        "l.weight": torch.randn(10, 64),
        "l.bias": torch.randn(10),
        "bn.weight": torch.randn(4),
    }
    top = {"c": 24, "l": 6}
    svds = {n: layer_svd(state[f"{n}.weight"], () if exact else (r // 4, r // 2, r)) for n, r in top.items()}
    factors = {n: wire_factors(svds[n], state[f"{n}.weight"].shape, r) for n, r in top.items()}
    for ranks in ({"c": 6, "l": 1}, {"c": 12, "l": 3}, {"c": 24, "l": 6}, {"c": 24}):
        alone, cut = factorize_state(state, ranks, svds), factorize_state(state, ranks, factors=factors)
        assert list(alone) == list(cut)
        for key in alone:
            assert cut[key].dtype == torch.float32 and cut[key].is_contiguous(), key
            assert torch.equal(alone[key], cut[key]), key
    with pytest.raises(ValueError, match=r"rank must be in \[1, 24\]"):
        factorize_state(state, {"c": 25}, factors=factors)


def test_fast_svd_at_full_rank_takes_the_exact_path_and_reproduces_the_layer():
    W = torch.randn(16, 8, 3, 3)
    svd = layer_svd(W, [4, full_rank(W.shape)])
    assert svd.S.dtype == torch.float64 and svd.S.numel() == full_rank(W.shape)
    hybrid = factorize_state({"L.weight": W}, {"L": full_rank(W.shape)}, {"L": svd})
    torch.testing.assert_close(recover_state(hybrid, {"L": full_rank(W.shape)})["L.weight"], W, rtol=1e-5, atol=1e-6)
    # a float64 layer always takes the exact path, whatever the ranks
    assert layer_svd(W.double(), [2]).S.dtype == torch.float64


def test_fast_svd_factors_are_balanced_and_cut_like_the_reference():
    M = torch.randn(120, 60) * 0.1
    svd = layer_svd(M, [10, 20])
    S = torch.linalg.svdvals(M.double())
    torch.testing.assert_close(svd.S.double(), S[:20], rtol=1e-5, atol=1e-7)
    A, B = split_factors(svd, 10)
    torch.testing.assert_close(A.norm(dim=0), B.norm(dim=1), rtol=1e-5, atol=1e-7)  # sqrt(S) on both sides
    torch.testing.assert_close(svd.U.t() @ svd.U, torch.eye(20), atol=1e-5, rtol=0)


@pytest.mark.parametrize("ranks", [[0], [7, 61]])
def test_fast_svd_refuses_ranks_out_of_range(ranks):
    with pytest.raises(ValueError, match=r"ranks must be in \[1, 60\]"):
        layer_svd(torch.randn(120, 60), ranks)
