"""Low-rank math of FedHM (docs/METHODS.md#fedhm-factorization): unrolling, exact factorized layers,
SVD truncation, wire format."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedhm_flwr.math.lowrank import (
    _swap_middle,
    compute_svds,
    conv_to_matrix,
    factorize_state,
    full_rank,
    layer_matrix,
    layer_svd,
    matrix_to_conv,
    rank_for,
    recover_state,
    split_factors,
)
from fedhm_flwr.models import build_model
from fedhm_flwr.models.layers import FactorizedConv2d, FactorizedLinear, factorize_modules, factorized_modules
from fedhm_flwr.models.rules import plan_ranks


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- unrolling


def test_conv_to_matrix_layout_and_round_trip():
    n, m, k = 5, 3, 3
    W = torch.randn(n, m, k, k)
    M = conv_to_matrix(W)
    assert M.shape == (n * k, m * k)
    for o, c, i, j in [(0, 0, 0, 0), (4, 2, 2, 1), (2, 1, 0, 2), (3, 0, 1, 1)]:
        assert M[o * k + i, c * k + j] == W[o, c, i, j]
    assert torch.equal(matrix_to_conv(M, n, m, k), W)
    M2 = torch.randn(n * k, m * k)
    assert torch.equal(conv_to_matrix(matrix_to_conv(M2, n, m, k)), M2)
    lin = torch.randn(4, 7)
    assert layer_matrix(lin) is lin


@pytest.mark.parametrize("shape", [(5, 3, 3, 3), (64, 32, 5, 5), (8, 16, 1, 1), (7, 1, 3, 3), (2, 3, 4, 5)])
def test_unrolling_by_gather_moves_the_same_values_as_the_permute(shape):
    """The index gather behind conv_to_matrix / matrix_to_conv (:func:`_swap_middle`) gives
    exactly ``permute(0, 2, 1, 3).contiguous()``: contiguous, own memory, any shape, also from a
    non-contiguous tensor and under autograd (where it is the permute itself)."""
    x = torch.randn(*shape)
    want = x.permute(0, 2, 1, 3).contiguous()
    got = _swap_middle(x)
    assert torch.equal(got, want) and got.is_contiguous() and got.shape == want.shape
    if x.shape[1] > 1 and x.shape[2] > 1:
        assert got.data_ptr() != x.data_ptr()
    assert torch.equal(_swap_middle(x.transpose(1, 2).contiguous().transpose(1, 2)), want)  # non-contiguous input
    g = x.clone().requires_grad_()
    _swap_middle(g).sum().backward()
    assert torch.equal(g.grad, torch.ones_like(x))
    if shape[2] == shape[3]:
        n, m, k, _ = shape
        assert torch.equal(conv_to_matrix(x), x.permute(0, 2, 1, 3).reshape(n * k, m * k))
        assert torch.equal(matrix_to_conv(conv_to_matrix(x), n, m, k), x)


# ---------------------------------------------------------------- exact at full rank


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (1, 0), (2, 0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n", [(6, 4), (3, 8)])
def test_full_rank_factorized_conv_equals_conv(stride, padding, bias, m, n):
    conv = nn.Conv2d(m, n, 3, stride=stride, padding=padding, bias=bias).double()
    r = full_rank(conv.weight.shape)
    assert r == 3 * min(m, n)
    fact = FactorizedConv2d.from_conv(conv, r)
    assert fact.b.weight.shape == (r, m, 1, 3) and fact.a.weight.shape == (n, r, 3, 1)
    assert fact.b.stride == (1, stride) and fact.a.stride == (stride, 1)
    x = torch.randn(2, m, 9, 10, dtype=torch.float64)
    torch.testing.assert_close(fact(x), conv(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fact.product(), conv.weight, rtol=1e-10, atol=1e-10)


def test_full_rank_factorized_conv_float32():
    conv = nn.Conv2d(16, 32, 3, stride=2, padding=1)
    fact = FactorizedConv2d.from_conv(conv, 3 * 16)
    x = torch.randn(4, 16, 8, 8)
    torch.testing.assert_close(fact(x), conv(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_full_rank_factorized_linear_equals_linear(bias):
    lin = nn.Linear(12, 7, bias=bias).double()
    fact = FactorizedLinear.from_linear(lin, 7)
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(fact(x), lin(x), rtol=1e-10, atol=1e-10)
    assert fact.product().shape == (7, 12)


def test_unsupported_convs_refused():
    with pytest.raises(ValueError):
        FactorizedConv2d.from_conv(nn.Conv2d(4, 4, 3, groups=2), 2)
    with pytest.raises(ValueError):
        FactorizedConv2d.from_conv(nn.Conv2d(4, 4, 3, dilation=2), 2)
    with pytest.raises(ValueError):
        FactorizedConv2d.from_conv(nn.Conv2d(4, 4, (3, 1)), 2)


# ---------------------------------------------------------------- truncation


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_truncated_factors_are_the_best_rank_r_approximation(kind):
    shape = (8, 6, 3, 3) if kind == "conv" else (9, 14)
    W = torch.randn(*shape, dtype=torch.float64)
    M = layer_matrix(W)
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    svd = layer_svd(W)
    assert svd.S.dtype == torch.float64
    for r in (1, 3, 5):
        A, B = split_factors(svd, r)
        assert A.shape == (M.shape[0], r) and B.shape == (r, M.shape[1])
        truncated = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
        torch.testing.assert_close(A @ B, truncated, rtol=1e-10, atol=1e-10)
        # Singular values split evenly: both factors carry sqrt(S).
        torch.testing.assert_close(A.norm(dim=0), S[:r].sqrt())
        torch.testing.assert_close(B.norm(dim=1), S[:r].sqrt())
        err = M - A @ B
        assert math.isclose(torch.linalg.norm(err).item(), S[r:].pow(2).sum().sqrt().item(), rel_tol=1e-9)
        assert math.isclose(torch.linalg.matrix_norm(err, ord=2).item(), S[r].item(), rel_tol=1e-9)

        # The module and the state-dict path give the same folded truncation.
        if kind == "conv":
            layer = FactorizedConv2d.from_conv(nn.Conv2d(6, 8, 3, padding=1, bias=False).double(), r, svd)
            folded = matrix_to_conv(truncated, 8, 6, 3)
        else:
            layer = FactorizedLinear.from_linear(nn.Linear(14, 9, bias=False).double(), r, svd)
            folded = truncated
        torch.testing.assert_close(layer.product(), folded, rtol=1e-10, atol=1e-10)
        hybrid = factorize_state({"L.weight": W}, {"L": r}, {"L": svd})
        rec = recover_state(hybrid, {"L": r})["L.weight"]
        torch.testing.assert_close(rec, folded.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_frobenius_sq_value_and_gradient(kind):
    if kind == "conv":
        layer = FactorizedConv2d(5, 7, 3, rank=4, padding=1).double()
    else:
        layer = FactorizedLinear(11, 6, rank=3).double()
    value = layer.frobenius_sq()
    naive = layer.product().pow(2).sum()
    torch.testing.assert_close(value, naive)
    grads = torch.autograd.grad(value, [layer.a.weight, layer.b.weight])
    naive_grads = torch.autograd.grad(naive, [layer.a.weight, layer.b.weight])
    for g, ng in zip(grads, naive_grads):
        torch.testing.assert_close(g, ng)
    assert layer.rank == (4 if kind == "conv" else 3)


# ---------------------------------------------------------------- rank rule and plan


def test_rank_rule():
    assert rank_for((64, 64, 3, 3), 1 / 8) == 8
    assert rank_for((512, 256, 3, 3), 1 / 12) == 43  # 42.67 -> 43
    assert rank_for((20, 20, 3, 3), 1 / 8) == 3  # 2.5 rounds half up, not to even
    assert rank_for((4, 4, 3, 3), 1 / 16) == 1  # tiny layer: at least 1
    assert rank_for((10, 100), 1 / 2) == 5  # linear: gamma * min(out, in)
    assert rank_for((10, 3), 1.0) == 3  # linear cap at full rank
    assert rank_for((16, 1, 3, 3), 1.0) == 3  # conv cap at k * min(m, n)
    for bad in (0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="gamma"):
            rank_for((8, 8, 3, 3), bad)


def test_plan_ranks_hybrid_rule():
    spec = {"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32, "width": 8}
    model = build_model(spec)
    assert plan_ranks(model, 1) == {}
    plan = plan_ranks(model, 1 / 2)
    names = model.factorizable_layers()
    assert list(plan) == names[2:]
    assert "layer1.0.conv1" not in plan and "conv1" not in plan and "fc" not in plan
    assert not any("shortcut" in name for name in names)
    assert plan["layer4.1.conv2"] == 32  # 64 out channels at width 8
    assert list(plan_ranks(model, 1 / 2, rho=0)) == names
    with pytest.raises(ValueError, match="rho"):
        plan_ranks(model, 1 / 2, rho=-1)
    with pytest.raises(ValueError, match="gamma"):
        plan_ranks(model, 0)
    # A plan made on an already factorized model is the same (shapes come from full_shape).
    factorize_modules(model, plan, spectral_init=False)
    assert plan_ranks(model, 1 / 2) == plan


# ---------------------------------------------------------------- state dicts and hybrid models


def _full_ranks(model):
    return {name: full_rank(model.get_submodule(name).weight.shape) for name in model.factorizable_layers()}


def test_factorize_recover_state_round_trip():
    spec = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 8}
    model = build_model(spec)
    state = model.state_dict()
    ranks = _full_ranks(model) | {"fc": 10}
    svds = compute_svds(state, ranks)
    hybrid = factorize_state(state, ranks, svds)
    assert "conv2.weight" not in hybrid and "conv2.b.weight" in hybrid and "fc.a.bias" in hybrid
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in hybrid.values())
    recovered = recover_state(hybrid, ranks)
    assert list(recovered) == list(state)
    for key in state:
        torch.testing.assert_close(recovered[key], state[key], rtol=1e-5, atol=1e-6)
    # Truncation: ranks below full give the truncated SVD and the bias is passed through.
    small = {"conv3": 4, "fc": 2}
    rec = recover_state(factorize_state(state, small), small)
    assert torch.equal(rec["fc.bias"], state["fc.bias"])
    assert torch.linalg.matrix_rank(conv_to_matrix(rec["conv3.weight"]), rtol=1e-4) == 4
    with pytest.raises(ValueError):
        recover_state(factorize_state(state, small), {"conv3": 5, "fc": 2})


@pytest.mark.parametrize("arch,channels,size", [("cnn", 1, 28), ("resnet18", 3, 32)])
def test_hybrid_model_loads_factorized_state_and_matches_at_full_rank(arch, channels, size):
    spec = {"arch": arch, "num_classes": 10, "in_channels": channels, "image_size": size, "width": 4}
    full = build_model(spec).eval()
    ranks = _full_ranks(full)
    hybrid_state = factorize_state(full.state_dict(), ranks)
    hybrid = build_model({**spec, "ranks": ranks}, spectral_init=False)
    assert list(hybrid.state_dict()) == list(hybrid_state)
    hybrid.load_state_dict(hybrid_state, strict=True)
    hybrid.eval()
    x = torch.randn(3, channels, size, size)
    with torch.no_grad():
        torch.testing.assert_close(hybrid(x), full(x), rtol=1e-4, atol=1e-4)
    # The hybrid of a real level loads too, and exposes its factorized layers.
    plan = plan_ranks(full, 1 / 4)
    small = build_model({**spec, "ranks": plan}, spectral_init=False)
    small.load_state_dict(factorize_state(full.state_dict(), plan), strict=True)
    assert {name for name, _ in factorized_modules(small)} == set(plan)


def test_factorize_modules_spectral_init_matches_factorize_state():
    spec = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 8}
    model = build_model(spec)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ranks = plan_ranks(model, 1 / 2)
    factorize_modules(model, ranks)
    expected = factorize_state(state, ranks)
    got = model.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)
