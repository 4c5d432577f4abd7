"""Budget matching (levels.match=fedhm_params|fedhm_macs|fedhm_memory): HeteroFL / FedRolex widths with
FedHM's parameters, MACs or training memory."""

import pytest
import torch
from flwr.app import ArrayRecord

from fedhm_flwr.config import ConfigError, model_spec, run_options
from fedhm_flwr.models import matching
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy, FedRolexStrategy, HeteroFLStrategy

RESNET18 = {"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32, "width": 64}


def test_resnet18_matches_the_papers_counts_near_the_journals_widths():
    rates, fedhm = matching.matched_rates(RESNET18, [1, 0.5, 0.25, 0.125])
    # FedHM's Table 2 (journal): 11.17M, 4.16M, 2.21M, 1.24M
    assert [round(p / 1e6, 2) for p in fedhm] == [11.17, 4.16, 2.21, 1.24]
    counts = [matching.submodel_params(RESNET18, r) for r in rates]
    assert all(abs(c - t) / t < 0.01 for c, t in zip(counts, fedhm))
    # the journal sets HeteroFL's widths to 1 / 0.64 / 0.5 / 0.35 "to reach a larger model size":
    # close to the matched ones, and never smaller
    journal = [1.0, 0.64, 0.5, 0.35]
    assert rates[0] == 1.0
    assert all(abs(r - j) <= 0.06 and r <= j for r, j in zip(rates, journal))


CNN = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 16}


@pytest.mark.parametrize("resource", matching.RESOURCES)
def test_the_matched_rate_is_the_closest_on_its_grid(resource):
    (rate,), (target,) = matching.matched_rates(CNN, [0.25], resource=resource)
    cost = lambda r: matching.submodel_cost(CNN, r, resource)  # noqa: E731
    best = abs(cost(rate) - target)
    assert best / target < 0.02
    for other in (rate - matching.MATCH_STEP, rate + matching.MATCH_STEP, rate - 0.01, rate + 0.01):
        assert abs(cost(other) - target) >= best


def test_each_resource_is_matched_on_its_own_figure():
    """FedHM's smallest level needs a larger share of the full model's MACs and memory than of its
    parameters, so a width matched on MACs or memory is wider than one matched on parameters."""
    rates = {res: matching.matched_rates(CNN, [0.125], resource=res)[0][0] for res in matching.RESOURCES}
    assert rates["params"] < rates["macs"] < rates["memory"] < 1
    full = {res: matching.submodel_cost(CNN, 1.0, res) for res in matching.RESOURCES}
    fedhm = {res: matching.fedhm_level_costs(CNN, [1.0], resource=res)[0] for res in matching.RESOURCES}
    assert fedhm == full  # gamma = 1 is the full model on every resource
    with pytest.raises(ValueError, match="resource='flops'; allowed: params, macs, memory"):
        matching.submodel_cost(CNN, 0.5, "flops")


@pytest.mark.parametrize(
    "cls,method,resource",
    [
        (HeteroFLStrategy, "heterofl", "params"),
        (FedRolexStrategy, "fedrolex", "params"),
        (HeteroFLStrategy, "heterofl", "macs"),
        (FedRolexStrategy, "fedrolex", "memory"),
    ],
)
def test_matched_strategy_sends_the_matched_width_and_reports_both_counts(toy_cfg, cls, method, resource):
    cfg = toy_cfg(f"method={method} levels.match=fedhm_{resource}")
    strategy = cls(run_options(cfg), model_spec(cfg))
    fedhm_cfg = toy_cfg()
    fedhm = FedHMStrategy(run_options(fedhm_cfg), model_spec(fedhm_cfg))
    plain = cls(run_options(toy_cfg(f"method={method}")), model_spec(cfg))
    assert strategy.levels == plain.levels == fedhm.levels  # the levels keep FedHM's names
    for index in range(len(strategy.levels)):
        cost = strategy.method.level_cost(index)
        assert cost[f"fedhm_{resource}"] == fedhm.method.level_cost(index)[resource]
        assert cost[resource] == matching.submodel_cost(
            strategy.method.spec,
            strategy.method.rates[index],
            resource,
            int(cfg.train.batch_size),
            float(cfg.train.momentum),
        )
        assert cost["params"] == matching.submodel_params(strategy.method.spec, strategy.method.rates[index])
        if index:  # matched widths differ from the unmatched width = gamma
            assert strategy.method.rates[index] != strategy.levels[index]
    state = initial_state(cfg.seed, strategy.method.spec)
    grid = LocalGrid(6, client_handlers())
    for msg in strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid):
        index = msg.content["config"]["level-index"]
        sent = msg.content["arrays"].to_torch_state_dict()
        assert sum(t.numel() for t in sent.values()) == strategy.method.level_cost(index)["params"]


def test_match_is_refused_with_its_allowed_values(toy_cfg):
    with pytest.raises(ConfigError, match=r"levels\.match.*none.*fedhm_params.*fedhm_macs.*fedhm_memory"):
        toy_cfg("method=heterofl levels.match=flops")


def test_match_leaves_fedhm_alone(toy_cfg):
    a, b = toy_cfg(), toy_cfg("levels.match=fedhm_params")
    sa, sb = FedHMStrategy(run_options(a), model_spec(a)), FedHMStrategy(run_options(b), model_spec(b))
    assert sa.method.ranks == sb.method.ranks
    state = initial_state(a.seed, sa.method.spec)
    sa.method.begin_round(1, state), sb.method.begin_round(1, state)
    _, pa, _ = sa.method.level_payload(2, state)
    _, pb, _ = sb.method.level_payload(2, state)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
