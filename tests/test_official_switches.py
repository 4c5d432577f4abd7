"""FedHM's official-code switches on known numbers: its softmax(-(1/gamma)/tau) weights with the
dynamic flag (uniform without), and the previous global model added at gamma = 1."""

import math

import numpy as np
import pytest
import torch

from fedhm_flwr.config import ConfigError, model_spec, run_options
from fedhm_flwr.math.aggregation import official_code_weights
from fedhm_flwr.math.lowrank import recover_state
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy
from fedhm_flwr.server.strategy import Reply


def test_official_weights_dynamic_are_softmax_of_minus_inverse_gamma_over_tau():
    w = official_code_weights([1.0, 0.5, 0.25, 0.125], tau=5.0, dynamic=True)
    e = [math.exp(-1 / 5), math.exp(-2 / 5), math.exp(-4 / 5), math.exp(-8 / 5)]
    assert w == pytest.approx([x / sum(e) for x in e], rel=1e-12)
    assert w[0] > w[1] > w[2] > w[3]


def test_official_weights_fixed_are_uniform_and_sample_counts_multiply():
    assert official_code_weights([1.0, 0.5, 0.125], tau=5.0, dynamic=False) == pytest.approx([1 / 3] * 3)
    w = official_code_weights([1.0, 0.5], tau=1.0, dynamic=True, num_examples=[1, 3])
    a, b = math.exp(-1), 3 * math.exp(-2)
    assert w == pytest.approx([a / (a + b), b / (a + b)], rel=1e-12)


def _setup(toy_cfg, extra):
    cfg = toy_cfg(f"levels.ratios=[1,0.5,0.25] {extra}")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    state = initial_state(cfg.seed, strategy.method.spec)
    strategy.method.begin_round(1, state)
    return cfg, strategy, state


def _reply(strategy, state, index, node, classes=(0, 1, 2), shift=0.0):
    _, payload, _ = strategy.method.level_payload(index, state)
    counts = np.zeros(10, dtype=np.int64)
    counts[list(classes)] = 5
    return Reply(node, index, strategy.levels[index], {k: v + shift for k, v in payload.items()}, 15, counts, {})


def test_previous_global_is_added_at_gamma_one_when_no_full_rank_reply(toy_cfg):
    _, strategy, state = _setup(toy_cfg, "method.add_previous_global=true method.tau=1")
    reply = _reply(strategy, state, 1, 7, shift=0.01)
    merged = strategy.method.merge(1, state, [reply])
    rec = recover_state(reply.state, strategy.method.ranks[1])
    w_reply, w_global = math.exp(0.5) / (math.exp(0.5) + math.exp(1)), math.exp(1) / (math.exp(0.5) + math.exp(1))
    for key in state:
        expected = w_reply * rec[key].double() + w_global * state[key].double()
        if key in strategy.method.classifier_keys:  # classes the client did not hold: the global's row alone
            expected[3:] = state[key][3:].double()
        torch.testing.assert_close(merged[key].double(), expected, rtol=1e-6, atol=1e-6)


def test_previous_global_is_not_added_when_a_full_rank_client_replied(toy_cfg):
    _, strategy, state = _setup(toy_cfg, "method.add_previous_global=true")
    _, plain, _ = _setup(toy_cfg, "")
    replies = [_reply(strategy, state, 0, 1, shift=0.02), _reply(strategy, state, 2, 2, shift=-0.01)]
    merged, reference = strategy.method.merge(1, state, replies), plain.method.merge(1, state, replies)
    assert all(torch.equal(merged[k], reference[k]) for k in state)


def test_without_the_switch_a_lone_low_rank_reply_is_the_new_model(toy_cfg):
    _, strategy, state = _setup(toy_cfg, "")
    reply = _reply(strategy, state, 2, 3, classes=range(10))
    rec = recover_state(reply.state, strategy.method.ranks[2])
    merged = strategy.method.merge(1, state, [reply])
    assert all(torch.allclose(merged[k], rec[k], atol=1e-6) for k in state)


def test_strategy_uses_official_weights_only_when_asked(toy_cfg):
    _, official, _ = _setup(toy_cfg, "method.official_weights=true levels.assignment=dynamic method.tau=5")
    _, fixed, _ = _setup(toy_cfg, "method.official_weights=true method.tau=5")
    _, journal, _ = _setup(toy_cfg, "method.tau=5")
    levels = [1.0, 0.25]
    e = [math.exp(-1 / 5), math.exp(-4 / 5)]
    assert official.method.weights(levels, None) == pytest.approx([x / sum(e) for x in e])
    assert fixed.method.weights(levels, None) == pytest.approx([0.5, 0.5])
    g = [math.exp(1 / 5), math.exp(0.25 / 5)]
    assert journal.method.weights(levels, None) == pytest.approx([x / sum(g) for x in g])


@pytest.mark.parametrize("key", ["method.official_weights", "method.add_previous_global"])
def test_switches_must_be_booleans(toy_cfg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        toy_cfg(f"{key}=maybe")
