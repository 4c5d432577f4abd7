"""A round's level evaluation (fedhm_flwr/server/evaluation.py ``evaluate_levels``) against an independent
recomputation, its max pooling against ``max_pool2d``, its test-set batches against a DataLoader's, and its
caches against a changed global state (#53)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhm_flwr.config import run_options
from fedhm_flwr.config.specs import model_spec
from fedhm_flwr.data.tensors import ImageTensorDataset
from fedhm_flwr.math.train import evaluate
from fedhm_flwr.models import build_model, deployable_network
from fedhm_flwr.models.batched import max_pool_tiles, merge_networks
from fedhm_flwr.server import evaluation as ev
from fedhm_flwr.server.evaluation import RoundView, evaluate_levels, make_evaluator
from fedhm_flwr.server.registry import METHODS


def _pool_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    odd = torch.randn(5, 3, 7, 9, generator=g)
    special = torch.randn(4, 2, 6, 6, generator=g)
    special[0, 0, 0, 0], special[0, 0, 0, 1] = float("nan"), 5.0  # NaN in a window propagates
    special[1, 1, 2:4, 2:4] = torch.tensor([[-0.0, 0.0], [-0.0, -0.0]])  # a window of zeros of both signs
    special[2, 0, 4, 4], special[3, 1, 1, 0] = float("inf"), float("-inf")
    special[3, 0] = float("-inf")  # a whole channel of -inf
    return [odd, special, torch.randn(2, 4, 3, 5, generator=g)]


@pytest.mark.parametrize("k", [2, 3])
def test_tiled_max_pooling_gives_max_pool2ds_values(k):
    for x in _pool_inputs():
        expected, got = F.max_pool2d(x, k), max_pool_tiles(x, k)
        assert got.shape == expected.shape and got.is_contiguous() and got.dtype == expected.dtype
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))  # equal values (±0 compare equal)
    strided = torch.randn(2, 6, 6, 3).permute(0, 3, 1, 2)  # not a contiguous NCHW batch: max_pool2d itself
    assert torch.equal(max_pool_tiles(strided, k), F.max_pool2d(strided, k))
    with pytest.raises(RuntimeError):  # smaller than a window: refused as max_pool2d refuses it
        max_pool_tiles(torch.randn(3, 2, k - 1, 5), k)


def test_only_tiling_max_pools_are_replaced_in_the_merged_graph():
    tiling = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten())
    overlapping = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(3, stride=2, padding=1), nn.Flatten())
    x = torch.randn(3, 1, 9, 9)
    for net, replaced in ((tiling, True), (overlapping, False)):
        merged = merge_networks([net.eval(), net.eval()])
        assert isinstance(merged, fx.GraphModule)
        calls = [n for n in merged.graph.nodes if n.op == "call_function" and n.target is max_pool_tiles]
        assert len(calls) == (1 if replaced else 0)
        with torch.no_grad():
            assert all(torch.equal(out, net(x)) for out in merged(x))


def _view(cfg) -> RoundView:
    opts = run_options(cfg)
    method = METHODS[str(cfg.method.name)](opts, model_spec(cfg))
    return RoundView(opts, method, make_evaluator(opts, torch.device("cpu")), None, None, dict, {}, 1)


def _trained_like(spec, seed: int) -> dict[str, torch.Tensor]:
    """A seeded model whose weights are far from their initial spectrum (so every level differs)."""
    torch.manual_seed(seed)
    state = build_model(spec).state_dict()
    g = torch.Generator().manual_seed(seed + 100)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in state.items()}


def _alone(view: RoundView, state) -> dict[str, float]:
    """Each model scored alone, as an exported model would be: the method's deployable model of each
    level built, loaded and run through :func:`evaluate` (a DataLoader over the test set, ``max_pool2d``)."""
    opts, method = view.opts, view.method
    test = view.evaluate_fn.test  # type: ignore[union-attr]
    out: dict[str, float] = {}
    models = [("global", method.global_model(state))]
    models += [(f"level_{g:g}", method.deployable(i, state)) for i, g in enumerate(method.levels)]
    for name, (spec, st) in models:
        figures = evaluate(deployable_network(spec, st)[1], test, opts.evaluation.batch_size, torch.device("cpu"))
        out[f"acc/{name}"], out[f"loss/{name}"] = figures["accuracy"], figures["loss"]
    return out


@pytest.mark.parametrize("extra", ["model.width=8", "model.width=8 method=heterofl", "evaluation.levels=false"])
def test_evaluate_levels_equals_each_model_scored_alone_bit_for_bit(toy_cfg, extra):
    view = _view(toy_cfg(f"{extra} dataset.max_test_examples=450 evaluation.batch_size=200"))
    state = _trained_like(view.method.spec, 1)
    got = evaluate_levels(view, state)
    expected = _alone(view, state)
    if not view.opts.evaluation.levels:
        expected = {k: v for k, v in expected.items() if k.endswith("/global")}
    assert {k: v for k, v in got.items() if k != "bn_stats"} == expected
    if view.opts.evaluation.levels:  # the levels' losses differ: each level was scored on its own model
        assert len({v for k, v in expected.items() if k.startswith("loss/level_")}) == len(view.method.levels)


def test_a_changed_global_state_is_never_served_an_earlier_factorization(toy_cfg):
    """The method keeps each layer's factors and each level's cut for the state they came from (the
    evaluation shares them with the next round's hand-out): a new state, or the same tensors changed in
    place, is scored as a fresh method scores it."""
    cfg = toy_cfg("model.width=8 dataset.max_test_examples=300")
    view = _view(cfg)
    first = _trained_like(view.method.spec, 1)
    figures_first = evaluate_levels(view, first)
    second = _trained_like(view.method.spec, 2)  # new tensors, other values
    assert evaluate_levels(view, second) == evaluate_levels(_view(cfg), second) != figures_first
    layer = view.method.factorized[-1]
    with torch.no_grad():
        second[f"{layer}.weight"].mul_(-2.0)  # the same tensor, changed in place
    assert evaluate_levels(view, second) == evaluate_levels(_view(cfg), second)
    again = {k: v.clone() for k, v in first.items()}  # the first state's values in new tensors
    assert evaluate_levels(view, again) == figures_first


def test_the_test_set_is_cut_into_a_dataloaders_batches():
    images, labels = torch.randn(23, 1, 4, 4), torch.arange(23) % 3
    for test in (ImageTensorDataset(images, labels, 3), TensorDataset(images, labels)):
        scorer = ev.TestSetScorer(test, 5, torch.device("cpu"))
        loader = list(DataLoader(test, batch_size=5, shuffle=False))
        assert len(scorer.batches) == len(loader) == 5
        for (x, y), (lx, ly) in zip(scorer.batches, loader, strict=True):
            assert torch.equal(x, lx) and torch.equal(y, ly) and x.dtype == lx.dtype and x.is_contiguous()
