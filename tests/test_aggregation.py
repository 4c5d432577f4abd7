"""FedHM's aggregation weights and the per-class classifier average."""

import math

import numpy as np
import pytest
import torch

from fedhm_flwr.aggregation import average_states, level_weights


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
    holds = np.array([[1, 1, 0, 0],   # client a holds classes 0, 1
                      [0, 1, 1, 0]], dtype=bool)  # client b holds 1, 2; nobody holds class 3
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
