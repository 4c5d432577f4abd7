"""FedLoRA hand-out / aggregation, CMGA and DeMA: exactness properties (fast, no data, no Flower)."""

from __future__ import annotations

import math

import pytest
import torch

from fedhm_flwr.math.cmga import cmga, default_scale
from fedhm_flwr.math.lora import aggregate_products, handout, handout_state, lora_rank, merge_lora_replies, random_rows
from fedhm_flwr.models.adapters import DeMAAdapter, LoRALinear, merge_dema


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ LoRA


def test_rank_rule_maps_levels_to_the_papers_ranks():
    assert [lora_rank(g, 16) for g in (1, 0.5, 0.25, 0.125)] == [16, 8, 4, 2]
    assert lora_rank(0.01, 16) == 1


@pytest.mark.parametrize("rank", [1, 2, 4, 8, 16])
def test_handout_error_equals_the_discarded_singular_values(rank):
    delta = torch.randn(24, 40, generator=_gen(1), dtype=torch.float64)
    S = torch.linalg.svdvals(delta)
    A, B = handout(delta, rank, random_rows(16, 40, _gen(2)))
    assert A.shape == (rank, 40) and B.shape == (24, rank)
    err = delta - B @ A
    assert torch.allclose(torch.linalg.norm(err) ** 2, (S[rank:] ** 2).sum(), rtol=1e-10)
    if rank < len(S):
        assert torch.allclose(torch.linalg.matrix_norm(err, ord=2), S[rank], rtol=1e-10)
    # spectral split: both factors carry sqrt(S)
    assert torch.allclose(torch.linalg.norm(A, dim=1), S[:rank].sqrt(), rtol=1e-10)
    assert torch.allclose(torch.linalg.norm(B, dim=0), S[:rank].sqrt(), rtol=1e-10)


def test_zero_singular_values_get_random_a_rows_and_zero_b_columns():
    rows = random_rows(16, 12, _gen(3))
    A, B = handout(torch.zeros(10, 12, dtype=torch.float64), 4, rows)
    assert torch.equal(A, rows[:4]) and torch.count_nonzero(B) == 0  # round 1: ΔW = 0 exactly
    # rank-2 ΔW handed out at rank 4: two true components, two started from random rows
    u, v = (
        torch.randn(10, 2, generator=_gen(4), dtype=torch.float64),
        torch.randn(2, 12, generator=_gen(5), dtype=torch.float64),
    )
    delta = u @ v
    A, B = handout(delta, 4, rows)
    assert torch.allclose(B @ A, delta, atol=1e-12)
    assert torch.equal(A[2:], rows[2:4]) and torch.count_nonzero(B[:, 2:]) == 0
    assert torch.count_nonzero(B[:, :2]) > 0
    # the start rows are nested across ranks: a rank-2 client gets the first rows of the rank-4 ones
    A2, _ = handout(torch.zeros(10, 12, dtype=torch.float64), 2, rows)
    assert torch.equal(A2, rows[:2])
    with pytest.raises(ValueError, match="rank"):
        handout(delta, 11, random_rows(11, 12, _gen(0)))


def test_handout_state_splits_only_the_deltas():
    state = {
        "blk.q.lora_delta": torch.randn(6, 8, generator=_gen(6)),
        "head.weight": torch.randn(2, 8, generator=_gen(7)),
    }
    out = handout_state(state, 3, {"blk.q": random_rows(4, 8, _gen(8))})
    assert set(out) == {"blk.q.lora_A", "blk.q.lora_B", "head.weight"}
    assert out["blk.q.lora_A"].dtype == torch.float32 and out["head.weight"] is state["head.weight"]


def test_aggregation_is_the_weighted_sum_of_products_never_of_factors():
    g = _gen(9)
    pairs = [(torch.randn(r, 8, generator=g), torch.randn(6, r, generator=g)) for r in (2, 4, 4)]
    w = [0.5, 0.3, 0.2]
    got = aggregate_products(pairs, w)
    want = sum(wi * (B.double() @ A.double()) for (A, B), wi in zip(pairs, w))
    assert torch.allclose(got, want, atol=1e-12)
    same_rank = pairs[1:]
    naive = sum(wi * B.double() for (_, B), wi in zip(same_rank, [0.5, 0.5])) @ sum(
        wi * A.double() for (A, _), wi in zip(same_rank, [0.5, 0.5])
    )
    assert not torch.allclose(aggregate_products(same_rank, [0.5, 0.5]), naive)
    # identical replies are conserved
    state = {"L.lora_delta": torch.zeros(6, 8)}
    reply = {"L.lora_A": pairs[0][0], "L.lora_B": pairs[0][1]}
    merged = merge_lora_replies(state, [reply, reply], [0.25, 0.75])["L.lora_delta"]
    assert torch.allclose(merged, pairs[0][1] @ pairs[0][0], atol=1e-6)


def test_lora_linear_equals_the_adapted_weight():
    base = torch.nn.Linear(8, 6)
    layer = LoRALinear.wrap(base, 3)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(5, 8)
    assert torch.allclose(layer(x), x @ (base.weight + layer.lora_B @ layer.lora_A).T + base.bias, atol=1e-5)
    assert layer.weight is base.weight


# ------------------------------------------------------------------------------------ CMGA


@pytest.mark.parametrize("n", [2, 3, 5])
def test_cmga_output_is_orthogonal_with_equal_norms_and_keeps_the_frobenius_norm(n):
    G = torch.randn(200, n, generator=_gen(10), dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1, 2.0, 3.0])[:n]
    Gt = cmga(G, eps=1e-12)
    c = default_scale(G)
    assert torch.allclose(Gt.T @ Gt, c**2 * torch.eye(n, dtype=torch.float64), atol=1e-8 * c**2)
    assert math.isclose(float(torch.linalg.norm(Gt)), float(torch.linalg.norm(G)), rel_tol=1e-8)
    # explicit c
    Gc = cmga(G, c=2.0, eps=1e-12)
    assert torch.allclose(Gc.T @ Gc, 4.0 * torch.eye(n, dtype=torch.float64), atol=1e-8)


def test_cmga_is_the_identity_for_one_model_type_and_commutes_with_scaling():
    g = torch.randn(50, 1, generator=_gen(11), dtype=torch.float64)
    assert torch.allclose(cmga(g), g, rtol=1e-7)
    G = torch.randn(50, 3, generator=_gen(12), dtype=torch.float64)
    assert torch.allclose(cmga(1e-6 * G), 1e-6 * cmga(G), rtol=1e-9)
    assert torch.count_nonzero(cmga(torch.zeros(7, 2))) == 0


def test_cmga_is_the_orthogonal_polar_factor():
    G = torch.randn(30, 3, generator=_gen(13), dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.allclose(cmga(G, c=1.0, eps=0.0), U @ Vh, atol=1e-10)


# ------------------------------------------------------------------------------------ DeMA


def _random_dema(members=(0, 1, 2), own=1, dim=12, h=5, seed=14):
    torch.manual_seed(seed)
    ad = DeMAAdapter(dim, h, members, own).double()
    with torch.no_grad():
        for p in ad.parameters():
            p.normal_()  # non-trivial bank, gates and up-projection
    return ad


def test_dema_merged_forward_equals_the_unmerged_forward():
    ad = _random_dema()
    merged_state = merge_dema(ad.state_dict(), ad.members)
    plain = DeMAAdapter(12, 5).double()
    plain.load_state_dict(merged_state, strict=True)
    x = torch.randn(7, 3, 12, dtype=torch.float64)
    assert torch.allclose(plain(x), ad(x), atol=1e-10, rtol=1e-10)
    # and in float32, to float32 tolerance
    ad32, plain32 = ad.float(), DeMAAdapter(12, 5)
    plain32.load_state_dict(merge_dema(ad32.state_dict(), ad32.members))
    assert torch.allclose(plain32(x.float()), ad32(x.float()), atol=1e-4, rtol=1e-4)


def test_dema_trains_only_its_own_share_adapters_and_starts_as_identity():
    ad = _random_dema()
    ad(torch.randn(4, 12, dtype=torch.float64)).sum().backward()
    with_grad = {k for k, p in ad.named_parameters() if p.grad is not None}
    assert with_grad == {
        "down.weight",
        "down.bias",
        "up.weight",
        "up.bias",
        "gate_pre",
        "gate_post",
        "share_pre.1",
        "share_post.1",
    }
    fresh = DeMAAdapter(12, 5, (0, 1), 0)
    assert torch.count_nonzero(fresh(torch.randn(3, 12))) == 0  # W_up = 0: the block is unchanged
