"""Untrusted clients, the pure math: robust aggregation over coverage masks (median, trimmed mean,
Krum, clipping, the outlier filter), the DP accountant and hostile numbers. Attacks, defences and DP
in whole rounds are in tests/test_robust_rounds.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from fedhm_flwr.math import privacy, robust

# ------------------------------------------------------------------------------------ pure math


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_median_trimmed_and_weighted_mean_over_the_covering_clients_on_known_numbers():
    prev = {"w": _t(-1, -1, -1, -1)}
    # element 0: everyone; 1: clients 0 and 1; 2: client 2 only; 3: nobody
    values = [
        {"w": _t(1, 10, 0, 9)},
        {"w": _t(2, 20, 0, 9)},
        {"w": _t(6, 99, 7, 9)},
        {"w": _t(7, 99, 0, 9)},
        {"w": _t(100, 99, 0, 9)},
    ]
    covers = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    masks = [{"w": torch.tensor(c, dtype=torch.bool)} for c in covers]
    median = robust.combine(prev, values, masks, "median")["w"]
    trimmed = robust.combine(prev, values, masks, "trimmed_mean", trim=0.25)["w"]
    mean = robust.combine(prev, values, masks, "mean", weights=[1, 1, 1, 1, 0])["w"]
    assert median.tolist() == [6, 15, 7, -1]
    assert trimmed.tolist() == [5, 15, 7, -1]  # floor(0.25 * 5) = 1 cut at each end of element 0
    assert mean.tolist() == [4, 15, 7, -1]  # weights renormalised over the covering clients


def test_classifier_rows_count_only_the_clients_holding_the_class():
    state = {"fc.weight": torch.ones(3, 2), "conv.weight": torch.ones(2)}
    mask = robust.with_class_rows(state, None, np.array([True, False, True]), ["fc.weight"])
    assert mask["fc.weight"].tolist() == [[True, True], [False, False], [True, True]]
    assert mask["conv.weight"].all()
    prev = {"fc.weight": torch.zeros(3, 2)}
    values = [{"fc.weight": torch.full((3, 2), 1.0)}, {"fc.weight": torch.full((3, 2), 3.0)}]
    masks = [
        robust.with_class_rows(v, None, np.array(h), ["fc.weight"])
        for v, h in zip(values, ([True, False, False], [True, True, False]))
    ]
    out = robust.combine(prev, values, masks, "median")["fc.weight"]
    assert out[:, 0].tolist() == [2.0, 3.0, 0.0]  # row 2: nobody holds class 2, keeps its value


def test_with_full_coverage_median_and_trimmed_mean_agree_with_flowers_helpers():
    gen = torch.Generator().manual_seed(0)
    values = [{"w": torch.randn(3, 4, generator=gen, dtype=torch.float64)} for _ in range(7)]
    prev = {"w": torch.zeros(3, 4, dtype=torch.float64)}
    stacked = np.stack([v["w"].numpy() for v in values])
    median = robust.combine(prev, values, [None] * 7, "median")["w"]
    trimmed = robust.combine(prev, values, [None] * 7, "trimmed_mean", trim=0.2)["w"]
    np.testing.assert_allclose(median.numpy(), np.median(stacked, axis=0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(trimmed.numpy(), trim_mean(stacked, 0.2), rtol=0, atol=1e-12)


def test_clipping_norms_bounds_and_the_outlier_filter():
    updates = [{"a": _t(3, 4, 100)}, {"a": _t(0.6, 0.8, 0)}]
    masks = [{"a": torch.tensor([True, True, False])}, None]
    norms = robust.update_norms(updates, masks)
    np.testing.assert_allclose(norms, [5.0, 1.0])  # the uncovered 100 does not count
    np.testing.assert_allclose(robust.clip_scales(norms, 2.0), [0.4, 1.0])
    assert robust.quantile_bound([1, 2, 3, 4], 0.5) == 2.5
    keep = robust.outlier_keep([1.0, 1.1, 0.9, 1.05, 0.95, 50.0], 3.0)
    assert keep.tolist() == [True, True, True, True, True, False]
    assert robust.outlier_keep([0.01, 1.0, 1.1, 0.9], 3.0).all()  # small updates are not outliers
    with pytest.raises(ValueError, match="bound"):
        robust.clip_scales(norms, 0.0)


def test_krum_picks_the_reply_closest_to_its_neighbours_as_flower_does():
    vectors = torch.tensor([[0.0], [1.0], [2.0], [10.0]], dtype=torch.float64)
    # n - f - 2 = 2 nearest: scores 1+4, 1+1, 1+4, 64+81
    np.testing.assert_allclose(robust.krum_scores(vectors, 0), [5, 2, 5, 145])
    assert robust.krum_select(vectors, 0) == [1]
    assert robust.krum_select(vectors, 0, m=2) == [1, 0]
    gen = torch.Generator().manual_seed(1)
    points = torch.cat(
        [
            torch.randn(6, 5, generator=gen, dtype=torch.float64),
            100 + torch.randn(2, 5, generator=gen, dtype=torch.float64),
        ]
    )
    contents = [RecordDict({"arrays": ArrayRecord([p.numpy()])}) for p in points]
    (chosen,) = select_multikrum(contents, num_malicious_nodes=2, num_nodes_to_select=1)
    assert robust.krum_select(points, 2) == [next(i for i, c in enumerate(contents) if c is chosen)]


# ------------------------------------------------------------------------------------ accountant


def test_accountant_reproduces_tensorflow_privacys_published_values():
    # tensorflow/privacy rdp_accountant_test.py: test_compute_rdp and test_get_privacy_spent
    # (the latter is the example of Abadi et al.: q = 0.01, sigma = 4, 10000 steps, delta = 1e-5)
    assert privacy.compute_rdp(0.1, 2, 10, [5])[0] == pytest.approx(0.07737, abs=1e-5)
    np.testing.assert_allclose(
        privacy.compute_rdp(0.01, 2.5, 50, [5, 50, 100]), [0.00218075, 0.023846, 167.416307], atol=1e-5
    )
    orders = list(range(2, 33))
    eps, order = privacy.epsilon_from_rdp(privacy.compute_rdp(0.01, 4, 10000, orders), 1e-5, orders)
    assert eps == pytest.approx(1.258575, abs=1e-5) and order == 20
    # computed once per (rate, noise, orders), each answer its own array: a caller that changes one
    # changes no later answer
    first = privacy.rdp_sampled_gaussian(0.1, 2, [5])
    first[:] = -1.0
    assert privacy.compute_rdp(0.1, 2, 10, [5])[0] == pytest.approx(0.07737, abs=1e-5)


def test_epsilon_grows_with_rounds_and_shrinks_with_the_noise_multiplier():
    def eps(rounds, sigma, q=0.5):
        acc = privacy.RdpAccountant()
        acc.step(q, sigma, rounds)
        return acc.epsilon(1e-5)

    assert 0 < eps(1, 1.0) < eps(10, 1.0) < eps(100, 1.0)
    assert eps(10, 0.7) > eps(10, 1.0) > eps(10, 2.0) > eps(10, 4.0) > 0
    assert privacy.RdpAccountant().epsilon(1e-5) == 0.0


# ------------------------------------------------------------------------------------ hostile numbers


def test_defences_never_select_or_produce_inf_nan_or_huge_values():
    honest = [_t(1.0, 2.0), _t(1.1, 2.1), _t(0.9, 1.9), _t(1.05, 2.05), _t(0.95, 1.95)]
    hostile = [_t(math.inf, -math.inf), _t(math.nan, math.nan), _t(1e20, -1e20), _t(1e200, 1e200)]
    rows = torch.stack(honest + hostile)
    scores = robust.krum_scores(rows, f=4)
    assert np.isinf(scores[[5, 6, 8]]).all() and np.isfinite(scores[:5]).all()
    picked = robust.krum_select(rows, f=4, m=9)
    assert set(picked) == {0, 1, 2, 3, 4, 7}  # never inf, NaN or the overflowing 1e200 (1e20 only when m asks for it)
    assert robust.krum_select(rows, f=4, m=5) == sorted(range(5), key=lambda i: (scores[i], i))
    assert robust.krum_select(torch.stack(hostile[:2]), f=0) == []
    prev = {"w": _t(0.0, 0.0)}
    values = [{"w": v} for v in honest + hostile]
    for rule, kwargs in (("median", {}), ("trimmed_mean", {"trim": 0.3}), ("mean", {"weights": [1] * 7})):
        out = robust.combine(prev, values[:5] + values[5:7], [None] * 7, rule, **kwargs)["w"]
        assert torch.isfinite(out).all()  # inf and NaN cover nothing
        if rule != "mean":
            out = robust.combine(prev, values, [None] * 9, rule, **kwargs)["w"]
            assert 0.9 <= float(out[0]) <= 1.1 and 1.9 <= float(out[1]) <= 2.1  # 1e20, 1e200 cut away
    norms = robust.update_norms([{"w": v} for v in honest[:1] + hostile], [None] * 5)
    scales = robust.clip_scales(norms, 1.0)
    assert scales[1] == 0 and scales[2] == 0 and scales[4] == 0 and 0 < scales[3] < 1e-19
    assert np.isfinite(robust.quantile_bound(norms, 0.5))  # the adaptive bound ignores inf/NaN
    assert robust.oversized({"w": _t(1e20, 0)}, 1e6).startswith("w has L2 norm")
    assert robust.oversized({"w": _t(math.inf, 0)}, 1e6) == "w holds NaN or Inf"
    assert robust.oversized({"w": _t(3, 4), "n": torch.tensor([10**9])}, 5.0) is None


def test_the_screens_one_op_pass_over_a_whole_reply_clears_only_what_the_per_tensor_passes_clear():
    """``flat`` (all of a reply's floating values) clears a reply at once only when its whole norm is
    within the bound; otherwise the per-tensor passes decide, with the same reasons as without it."""
    within = {"a": _t(3.0, 0.0), "b": _t(0.0, 4.0)}  # each norm <= 4, the whole's 5
    flat = torch.cat([v.reshape(-1) for v in within.values()])
    assert robust.oversized(within, 5.0, flat) is None
    assert robust.oversized(within, 4.5, flat) is None  # whole 5 > 4.5: the per-tensor pass clears it
    assert robust.oversized(within, 3.5, flat) == "b has L2 norm 4, above the bound 3.5 (aggregation.max_norm)"
    for bad in (math.nan, math.inf, -math.inf):
        state = {"a": _t(1.0, 0.0), "b": _t(0.0, bad)}
        flat = torch.cat([v.reshape(-1) for v in state.values()])
        assert robust.oversized(state, 1e6, flat) == "b holds NaN or Inf"
    big = {"a": _t(3e30, 0.0)}  # float32 squares overflow to inf: not cleared by the one op
    assert robust.oversized(big, 1e15, big["a"]).startswith("a has L2 norm 3e+30")
    assert robust.oversized({}, 1.0, torch.zeros(0)) is None
