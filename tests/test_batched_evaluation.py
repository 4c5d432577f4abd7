"""The levels of a round evaluated in one pass (fedhm_flwr/models/batched.py): every output equal bit for bit
to the network run alone, the shared prefix computed once, and networks that cannot be merged safely refused
(the scorer then runs them one by one, with the same figures)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhm_flwr.config import run_options
from fedhm_flwr.config.specs import model_spec
from fedhm_flwr.math.train import evaluate_batches
from fedhm_flwr.models import build_model, deployable_network
from fedhm_flwr.models.batched import merge_networks
from fedhm_flwr.server.evaluation import distinct_models, make_evaluator
from fedhm_flwr.server.registry import METHODS


def _level_networks(cfg, seed: int = 0) -> list[nn.Module]:
    spec = model_spec(cfg)
    method = METHODS[str(cfg.method.name)](run_options(cfg), spec)
    torch.manual_seed(seed)
    models, _ = distinct_models(method, build_model(spec).state_dict())
    return [deployable_network(s, st, None)[1].eval() for s, st in models]


def _convs(module: nn.Module) -> int:
    return sum(isinstance(m, nn.Conv2d) for m in module.modules())


def test_fedhm_levels_run_as_one_equal_bit_for_bit_with_the_full_rank_prefix_once(toy_cfg):
    nets = _level_networks(toy_cfg("model.width=16"))
    assert len(nets) == 4  # global (= level 1) and levels 1/2, 1/4, 1/8
    merged = merge_networks(nets)
    assert merged is not None
    x = torch.randn(64, 1, 28, 28)
    with torch.no_grad():
        alone = [n(x) for n in nets]
        together = merged(x)
    assert len(together) == len(nets)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    # conv1 and conv2 (stem and the first rho=1 layer at full rank) are the same in every level: held once
    assert _convs(merged) == sum(_convs(n) for n in nets) - 2 * (len(nets) - 1)


def test_the_scorer_gives_the_same_figures_in_one_pass_as_model_by_model(toy_cfg):
    for extra in ("", "method=heterofl", "method=prism", "model=resnet18 model.width=4 dataset.max_test_examples=64"):
        cfg = toy_cfg(extra)
        spec = model_spec(cfg)
        method = METHODS[str(cfg.method.name)](run_options(cfg), spec)
        torch.manual_seed(1)
        models, _ = distinct_models(method, build_model(spec).state_dict())
        scorer = make_evaluator(run_options(cfg), torch.device("cpu"))
        assert scorer.many([(s, st, None) for s, st in models]) == [scorer(s, st) for s, st in models], extra


def _bn_net(mean: float) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(), nn.LazyLinear(3))
    net(torch.zeros(1, 1, 6, 6))
    net[1].running_mean.fill_(mean)
    return net.eval()


def test_layers_that_differ_in_a_buffer_or_an_attribute_are_not_shared():
    x = torch.randn(8, 1, 6, 6)
    a, b = _bn_net(0.0), _bn_net(0.5)  # the same weights, other fixed statistics (federated sBN per level)
    merged = merge_networks([a, b])
    assert merged is not None
    with torch.no_grad():
        out = merged(x)
        assert torch.equal(out[0], a(x)) and torch.equal(out[1], b(x))
        assert not torch.equal(out[0], out[1])
    strided = _bn_net(0.0)
    strided[0].stride = (2, 2)  # same weights, another stride
    strided[4] = nn.Linear(4 * 2 * 2, 3)
    merged = merge_networks([a, strided])
    assert merged is not None
    with torch.no_grad():
        assert torch.equal(merged(x)[1], strided(x))
    assert _convs(merged) == 2


class _AddsInPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)  # (``y += 1`` traces as an out-of-place add: harmless)
        return torch.relu_(y)


class _Branches(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_networks_writing_in_place_or_untraceable_are_refused_and_scored_one_by_one(toy_cfg, monkeypatch):
    assert merge_networks([_AddsInPlace(), _AddsInPlace()]) is None
    assert merge_networks([_Branches(), _Branches()]) is None
    # the scorer's fallback: the same figures as model by model when merging is refused
    cfg = toy_cfg()
    spec = model_spec(cfg)
    method = METHODS["fedhm"](run_options(cfg), spec)
    models, _ = distinct_models(method, build_model(spec).state_dict())
    scorer = make_evaluator(run_options(cfg), torch.device("cpu"))
    expected = [scorer(s, st) for s, st in models]
    monkeypatch.setattr("fedhm_flwr.server.evaluation.merge_networks", lambda *args: None)
    assert scorer.many([(s, st, None) for s, st in models]) == expected


def test_batches_scored_side_by_side_in_single_threaded_kernels_give_the_split_kernels_figures(toy_cfg):
    """The scorer's batches run ``workers`` at a time, each with one torch thread: every figure equal bit for bit
    to the batches run one by one with every kernel split over the threads, for each model family."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        families = (
            "model.width=16",
            "method=heterofl",
            "model=resnet18 model.width=4",
            "model=vit model.width=16 model.depth=2",
        )
        for extra in families:
            cfg = toy_cfg(f"{extra} dataset.max_test_examples=120 evaluation.batch_size=16")
            spec = model_spec(cfg)
            method = METHODS[str(cfg.method.name)](run_options(cfg), spec)
            torch.manual_seed(2)
            models, _ = distinct_models(method, build_model(spec).state_dict())
            nets = [deployable_network(s, st, None)[1].eval() for s, st in models]
            scorer = make_evaluator(run_options(cfg), torch.device("cpu"))
            assert len(scorer.batches) == 8  # 120 images: seven batches of 16 and one of 8
            for net in nets:
                split = evaluate_batches(net, scorer.batches, torch.device("cpu"), outputs=0, workers=1)
                for workers in (2, 3):
                    assert evaluate_batches(net, scorer.batches, torch.device("cpu"), 0, workers) == split, extra
                assert torch.get_num_threads() == 2  # the caller's thread count is back
            # the default: as many batches at once as torch has threads
            assert scorer.many([(s, st, None) for s, st in models]) == [
                evaluate_batches(n, scorer.batches, torch.device("cpu"), outputs=0, workers=1)[0] for n in nets
            ], extra
    finally:
        torch.set_num_threads(threads)


def test_a_batch_that_fails_fails_the_scoring_and_the_thread_count_is_back():
    class _FailsOnNegatives(nn.Module):
        def forward(self, x):
            if x.min() < 0:
                raise ValueError("negative input")
            return x.flatten(1)[:, :3]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batches = [(torch.ones(4, 1, 2, 2), torch.zeros(4, dtype=torch.long)) for _ in range(5)]
        batches[3] = (-batches[3][0], batches[3][1])
        with pytest.raises(ValueError, match="negative input"):
            evaluate_batches(_FailsOnNegatives(), batches, torch.device("cpu"), outputs=0, workers=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_each_levels_graph_is_traced_once_a_run_and_reused_with_the_new_weights(toy_cfg, monkeypatch):
    """The scorer traces each level's network in the first round only (``Traces``, keyed by the model spec): the
    later rounds' networks, rebuilt with new weights, run the reused graphs with the same figures as model by
    model; a network that does not fit a kept graph (another layer type at one of its targets) is traced afresh."""
    from torch import fx

    from fedhm_flwr.models import batched

    traced: list[str] = []
    real = fx.symbolic_trace
    monkeypatch.setattr(batched.fx, "symbolic_trace", lambda net: traced.append(type(net).__name__) or real(net))
    cfg = toy_cfg("model.width=8")
    spec = model_spec(cfg)
    method = METHODS["fedhm"](run_options(cfg), spec)
    scorer = make_evaluator(run_options(cfg), torch.device("cpu"))
    for server_round in range(3):
        torch.manual_seed(server_round)
        models, _ = distinct_models(method, build_model(spec).state_dict())
        assert scorer.many([(s, st, None) for s, st in models]) == [scorer(s, st) for s, st in models]
    assert len(traced) == len(models) == 4  # the global model (= level 1) and three low-rank levels, once each

    # a network that does not fit the graph kept under its key (another layer type at a target) is traced afresh
    traces, x = batched.Traces(), torch.randn(4, 1, 6, 6)
    relu, tanh = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh())
    traced.clear()
    assert batched.merge_networks([relu], ["same key"], traces) is not None
    merged = batched.merge_networks([tanh], ["same key"], traces)
    assert len(traced) == 2
    with torch.no_grad():
        assert torch.equal(merged(x)[0], tanh(x))
    # a kept trace holds nothing of the network it was traced from: that network's weights are freed
    import gc
    import weakref

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    weight = weakref.ref(net[0].weight)
    traces.trace(net, "kept")
    del net
    gc.collect()
    assert weight() is None and traces.trace(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), "kept").graph is not None


def test_a_layer_is_compared_only_with_the_layers_already_run_on_the_same_input(monkeypatch):
    """Merging compares a network's layer with the earlier networks' layers of the same type on the same input
    only, not with every layer held: levels of a deep network merge in a number of comparisons bounded by their
    layers (the whole-list scan made about 23 000 comparisons for these four shufflenets, seconds a round)."""
    import torchvision

    from fedhm_flwr.models import batched

    nets = []
    for seed in range(4):
        torch.manual_seed(0 if seed < 2 else seed)  # two equal networks, then two others
        nets.append(torchvision.models.shufflenet_v2_x0_5(num_classes=5).eval())
    calls = 0
    real = batched._same_module

    def counted(a, b):
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(batched, "_same_module", counted)
    merged = batched.merge_networks(nets)
    layers = sum(1 for _ in nets[0].modules())
    assert merged is not None and calls <= 4 * layers
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        outs = merged(x)
        assert all(torch.equal(a, n(x)) for a, n in zip(outs, nets, strict=True))
    # the two equal networks are computed once: every operation of the second is shared
    assert batched.distinct_operations(merged) == 3 * batched.distinct_operations(nets[0])
