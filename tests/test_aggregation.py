"""FedHM's aggregation weights and the per-class classifier average."""

import math

import numpy as np
import pytest
import torch

from fedhm_flwr.math.aggregation import average_hybrid, average_states, level_weights


def test_weights_are_softmax_of_gamma_over_tau():
    gammas, tau = [1.0, 0.5, 0.25, 0.125, 0.125], 0.7
    expected = np.exp(np.array(gammas) / tau) / np.exp(np.array(gammas) / tau).sum()
    np.testing.assert_allclose(level_weights(gammas, tau), expected, rtol=1e-12)


def test_infinite_tau_is_the_plain_mean_and_large_tau_tends_to_it():
    gammas = [1.0, 0.5, 0.125]
    np.testing.assert_allclose(level_weights(gammas, math.inf), np.full(3, 1 / 3))
    assert np.abs(level_weights(gammas, 1e6) - 1 / 3).max() < 1e-6
    assert np.abs(level_weights(gammas, 1.0) - 1 / 3).max() > 0.05  # tau matters


def test_sample_count_weighting_multiplies_and_renormalises():
    gammas, counts = [1.0, 0.5], [100, 300]
    soft = level_weights(gammas, 1.0)
    expected = soft * np.array(counts) / (soft * np.array(counts)).sum()
    np.testing.assert_allclose(level_weights(gammas, 1.0, counts), expected)
    with pytest.raises(ValueError):
        level_weights(gammas, 1.0, [0, 3])
    with pytest.raises(ValueError):
        level_weights(gammas, 0.0)


def test_weighted_average_and_classifier_rows_per_class():
    prev = {"w": torch.zeros(3), "fc.weight": torch.full((4, 2), -1.0), "fc.bias": torch.full((4,), -1.0)}
    a = {"w": torch.ones(3), "fc.weight": torch.ones(4, 2), "fc.bias": torch.ones(4)}
    b = {"w": torch.full((3,), 3.0), "fc.weight": torch.full((4, 2), 3.0), "fc.bias": torch.full((4,), 3.0)}
    holds = np.array(
        [
            [1, 1, 0, 0],  # client a holds classes 0, 1
            [0, 1, 1, 0],
        ],
        dtype=bool,
    )  # client b holds 1, 2; nobody holds class 3
    out = average_states(prev, [a, b], [0.25, 0.75], holds, ["fc.weight", "fc.bias"])
    assert torch.allclose(out["w"], torch.full((3,), 0.25 * 1 + 0.75 * 3))
    rows = out["fc.weight"][:, 0]
    assert rows[0] == 1.0  # only a held class 0
    assert rows[1] == pytest.approx(0.25 * 1 + 0.75 * 3)  # both held class 1
    assert rows[2] == 3.0  # only b
    assert rows[3] == -1.0  # nobody: previous row kept
    assert out["fc.bias"].tolist() == [1.0, pytest.approx(2.5), 3.0, -1.0]


def test_averaging_identical_states_conserves_them():
    s = {"x": torch.randn(5, 4), "fc.weight": torch.randn(3, 4)}
    holds = np.ones((3, 3), dtype=bool)
    out = average_states(s, [s, s, s], level_weights([1, 0.5, 0.25], 1.0), holds, ["fc.weight"])
    for k in s:
        assert torch.allclose(out[k], s[k], atol=1e-6)


def _reference_average(prev, full_states, weights, holds, classifier_keys):
    """The average written out key by key, client by client, row by row, in float64."""
    out = {}
    for key, p in prev.items():
        acc = sum(float(w) * s[key].double() for w, s in zip(weights, full_states))
        if key in classifier_keys:
            for c in range(p.shape[0]):
                tot = sum(float(w) for w, h in zip(weights, holds[:, c]) if h)
                acc[c] = (
                    (
                        sum(float(w) * s[key][c].double() for w, s, h in zip(weights, full_states, holds[:, c]) if h)
                        / tot
                    )
                    if tot > 0
                    else p[c].double()
                )
        out[key] = acc.to(p.dtype)
    return out


def test_hybrid_average_equals_recover_then_average_reference():
    """FedHM's stacked path (one product per layer over all replies, ranks mixed, full-rank replies
    included) equals recovering every reply and averaging key by key, to float32 tolerance."""
    from fedhm_flwr.math.lowrank import factorize_state, recover_state
    from fedhm_flwr.models import build_model
    from fedhm_flwr.models.rules import plan_ranks

    torch.manual_seed(0)
    model = build_model({"arch": "resnet18", "width": 8, "num_classes": 10, "in_channels": 3, "image_size": 32})
    prev = {k: v for k, v in model.state_dict().items() if k.endswith(("weight", "bias"))}
    gammas = [1.0, 0.5, 0.25, 0.125, 0.5, 1.0]
    ranks = [plan_ranks(model, g, 1) for g in gammas]
    clients = [{k: v + 0.01 * torch.randn_like(v) for k, v in prev.items()} for _ in gammas]
    hybrids = [factorize_state(c, r) if r else c for c, r in zip(clients, ranks)]
    weights = level_weights(gammas, 1.0)
    holds = np.random.default_rng(0).random((len(gammas), 10)) < 0.5
    holds[:, 3] = False  # a class nobody held keeps its previous rows
    keys = ["fc.weight", "fc.bias"]
    out = average_hybrid(prev, hybrids, ranks, weights, holds, keys)
    ref = _reference_average(prev, [recover_state(h, r) for h, r in zip(hybrids, ranks)], weights, holds, keys)
    assert list(out) == list(prev) and any(ranks)
    for k in prev:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6)
    assert torch.equal(out["fc.weight"][3], prev["fc.weight"][3])


def test_factorized_classifier_is_refused():
    prev = {"fc.weight": torch.zeros(4, 3)}
    hybrid = {"fc.b.weight": torch.zeros(1, 3), "fc.a.weight": torch.zeros(4, 1)}
    with pytest.raises(ValueError, match="per class"):
        average_hybrid(prev, [hybrid], [{"fc": 1}], [1.0], np.ones((1, 4), bool), ["fc.weight"])
