"""Width slicing of HeteroFL / FedRolex (docs/METHODS.md#heterofl, #fedrolex): channel rule, plans,
windows, aggregation, Scaler."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fedhm_flwr.math.width import (
    aggregate,
    channel_indices,
    embed,
    index_plan,
    scaled_channels,
    slice_state,
    submodel_spec,
    window_start,
)
from fedhm_flwr.models import build_model, count_parameters
from fedhm_flwr.models.layers import Scaler

R18 = {"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32}
with torch.device("meta"):  # the plans need the full model's shapes only
    R18_SHAPES = build_model(R18)
CNN4 = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 4}

#: HeteroFL's a..e and the FedHM journal's matched-size set, as exact fractions
RATES = {
    1.0: Fraction(1),
    0.5: Fraction(1, 2),
    0.25: Fraction(1, 4),
    0.125: Fraction(1, 8),
    0.0625: Fraction(1, 16),
    0.64: Fraction(16, 25),
    0.35: Fraction(7, 20),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def r18_state():
    torch.manual_seed(0)
    return build_model(R18).state_dict()


def _c(channels: int, rate: Fraction) -> int:
    """The channel rule, in exact arithmetic: ceil(rate * C)."""
    return math.ceil(rate * channels)


def _expected_r18_params(rate: Fraction, num_classes: int = 10) -> int:
    """ResNet-18 (CIFAR) parameters with every hidden width C -> ceil(rate*C), counted by hand."""
    conv = lambda cin, cout, k: cin * cout * k * k  # noqa: E731  (no conv bias)
    bn = lambda c: 2 * c  # noqa: E731  (sBN: weight and bias, no running statistics)
    stem = _c(64, rate)
    total = conv(3, stem, 3) + bn(stem)
    full_in, sub_in = 64, stem
    for stage in range(4):
        full_out = 64 * 2**stage
        sub_out = _c(full_out, rate)
        for block in range(2):
            a = sub_in if block == 0 else sub_out
            total += conv(a, sub_out, 3) + bn(sub_out) + conv(sub_out, sub_out, 3) + bn(sub_out)
            if block == 0 and (stage > 0 or full_in != full_out):  # downsample shortcut of the full model
                total += conv(a, sub_out, 1) + bn(sub_out)
        full_in, sub_in = full_out, sub_out
    return total + sub_in * num_classes + num_classes


# ---------------------------------------------------------------- channel rule and shapes


def test_channel_rule_is_ceil_with_float_noise_absorbed():
    assert scaled_channels(64, 0.35) == 23 and scaled_channels(128, 0.35) == 45  # not 2 * 23
    assert scaled_channels(20, 0.35) == 7  # 0.35 * 20 = 7.000000000000001 in floats
    assert scaled_channels(25, 0.64) == 16
    assert scaled_channels(8, 0.0625) == 1 and scaled_channels(1, 0.125) == 1
    assert scaled_channels(64, 1) == 64
    for bad in (0, -0.5, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="width rate"):
            scaled_channels(64, bad)


def test_expected_count_formula_is_the_standard_resnet18_at_rate_1():
    assert _expected_r18_params(Fraction(1)) == 11_173_962


@pytest.mark.parametrize("rate", list(RATES))
def test_resnet18_submodel_shapes_and_exact_counts(rate, r18_state):
    exact = RATES[rate]
    with torch.device("meta"):
        sub = build_model(submodel_spec(R18, rate))
    assert count_parameters(sub) == _expected_r18_params(exact)
    sub_state = sub.state_dict()
    assert list(sub_state) == list(r18_state)  # same keys, same order as the full model
    c = lambda ch: _c(ch, exact)  # noqa: E731
    expected = {
        "conv1.weight": (c(64), 3, 3, 3),  # input image channels always full
        "bn1.weight": (c(64),),
        "layer1.0.conv1.weight": (c(64), c(64), 3, 3),
        "layer2.0.conv1.weight": (c(128), c(64), 3, 3),
        "layer2.0.shortcut.0.weight": (c(128), c(64), 1, 1),  # same input as the block's first conv
        "layer2.0.shortcut.1.bias": (c(128),),
        "layer3.1.conv2.weight": (c(256), c(256), 3, 3),
        "layer4.1.bn2.weight": (c(512),),
        "fc.weight": (10, c(512)),  # classifier outputs always full, input follows the last layer
        "fc.bias": (10,),
    }
    for key, shape in expected.items():
        assert tuple(sub_state[key].shape) == shape, key
    sliced = slice_state(r18_state, index_plan(R18_SHAPES, rate))
    assert {k: tuple(v.shape) for k, v in sliced.items()} == {k: tuple(v.shape) for k, v in sub_state.items()}


def test_submodel_keeps_the_full_models_shortcuts_when_sliced_widths_coincide():
    spec = {**R18, "width": 8}
    with torch.device("meta"):
        full = build_model(spec)
        sub = build_model(submodel_spec(spec, 0.0625))  # widths 8, 16 -> 1, 1
    assert sub.layer2[0].conv1.in_channels == sub.layer2[0].conv1.out_channels == 1
    assert list(sub.state_dict()) == list(full.state_dict())


def test_cnn_submodel_follows_the_rule_and_loads_its_slice():
    spec = {**CNN4, "width": 20}
    full = build_model(spec)
    sub = build_model(submodel_spec(spec, 0.35))
    assert sub.hidden == [7, 14, 28, 56]
    sub.load_state_dict(slice_state(full.state_dict(), index_plan(full, 0.35)), strict=True)
    assert sub(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_static_plan_keeps_the_first_channels(r18_state):
    plan = index_plan(R18_SHAPES, 0.25)
    out, inp, kh, kw = plan["layer2.0.conv1.weight"]
    assert torch.equal(out, torch.arange(32)) and torch.equal(inp, torch.arange(16)) and kh is kw is None
    assert plan["conv1.weight"][1] is None  # the image channels
    assert plan["fc.weight"][0] is None and torch.equal(plan["fc.weight"][1], torch.arange(128))
    assert plan["fc.bias"] == (None,)
    sub = slice_state(r18_state, plan)
    assert torch.equal(sub["layer2.0.conv1.weight"], r18_state["layer2.0.conv1.weight"][:32, :16])
    assert torch.equal(sub["fc.weight"], r18_state["fc.weight"][:, :128])
    assert torch.equal(sub["layer4.0.bn1.bias"], r18_state["layer4.0.bn1.bias"][:128])


def test_full_rate_slice_is_the_full_state_copied(r18_state):
    for mode, rnd in (("static", 1), ("rolling", 37)):
        sub = slice_state(r18_state, index_plan(R18_SHAPES, 1.0, mode, rnd))
        assert all(torch.equal(sub[k], r18_state[k]) for k in r18_state)
        assert all(sub[k].data_ptr() != r18_state[k].data_ptr() for k in r18_state)


# ---------------------------------------------------------------- FedRolex window


def test_window_counts_rounds_from_zero():
    assert window_start(1) == 0 and window_start(5) == 4
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="server_round"):
            window_start(bad)


def test_rolling_window_moves_one_channel_per_round_and_wraps():
    # K = 10 channels, rate 0.3 -> 3 channels: {(i + j) mod 10 : i < 3}, j = round - 1
    assert channel_indices(10, 0.3, "rolling", server_round=1).tolist() == [0, 1, 2]  # = HeteroFL's slice
    assert channel_indices(10, 0.3, "rolling", server_round=4).tolist() == [3, 4, 5]
    assert channel_indices(10, 0.3, "rolling", server_round=9).tolist() == [0, 8, 9]  # wrap-around
    assert channel_indices(10, 0.3, "rolling", server_round=10).tolist() == [0, 1, 9]
    assert channel_indices(10, 0.3, "rolling", server_round=11).tolist() == [0, 1, 2]  # full cycle
    assert channel_indices(10, 0.3, "static", server_round=9).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="mode"):
        channel_indices(10, 0.3, "random")


def test_rolling_plan_is_consistent_between_layers_and_slices_the_window():
    full = build_model(CNN4)  # hidden 4, 8, 16, 32
    state = full.state_dict()
    plan = index_plan(full, 0.5, "rolling", server_round=7)  # j = 6
    assert plan["conv1.weight"][0].tolist() == [2, 3]  # K = 4: {6 mod 4, 7 mod 4}
    assert plan["conv2.weight"][0].tolist() == [0, 1, 6, 7]  # K = 8: {6, 7, 8 mod 8, 9 mod 8}
    assert plan["conv4.weight"][0].tolist() == list(range(6, 22))  # K = 32: no wrap
    for a, b in (("conv1", "conv2"), ("conv2", "conv3"), ("conv3", "conv4")):
        assert torch.equal(plan[f"{a}.weight"][0], plan[f"{b}.weight"][1])  # outputs feed the next inputs
        assert torch.equal(plan[f"{a}.weight"][0], plan[f"{a.replace('conv', 'bn')}.weight"][0])
    assert torch.equal(plan["fc.weight"][1], plan["conv4.weight"][0])
    sub = slice_state(state, plan)
    rows, cols = plan["conv2.weight"][0], plan["conv2.weight"][1]
    assert torch.equal(sub["conv2.weight"], state["conv2.weight"][rows][:, cols])
    model = build_model(submodel_spec(CNN4, 0.5))
    model.load_state_dict(sub, strict=True)


# ---------------------------------------------------------------- aggregation


def _cnn_states(rates, mode="static", rnd=1):
    torch.manual_seed(1)
    full = build_model(CNN4)
    previous = {k: torch.randn_like(v) for k, v in full.state_dict().items()}
    plans = [index_plan(full, r, mode, rnd) for r in rates]
    subs = [{k: torch.randn_like(v) for k, v in slice_state(previous, p).items()} for p in plans]
    return previous, plans, subs


def test_each_element_is_the_mean_over_its_holders_and_untouched_ones_stay():
    previous, plans, subs = _cnn_states([0.5, 0.25, 0.25])  # nobody trains the full model
    new = aggregate(previous, subs, plans)
    w, s = previous["conv2.weight"], [x["conv2.weight"] for x in subs]  # (8, 4, 3, 3); 0.5: 4x2, 0.25: 2x1
    assert torch.allclose(new["conv2.weight"][:2, :1], (s[0][:2, :1] + s[1] + s[2]) / 3)
    assert torch.allclose(new["conv2.weight"][2:4, :2], s[0][2:4, :2])
    assert torch.allclose(new["conv2.weight"][:2, 1:2], s[0][:2, 1:2])
    assert torch.equal(new["conv2.weight"][4:], w[4:]) and torch.equal(new["conv2.weight"][:, 2:], w[:, 2:])
    assert torch.equal(new["conv1.weight"][2:], previous["conv1.weight"][2:])  # conv1: 4 -> 2 and 1 channels
    assert torch.allclose(
        new["bn1.bias"][:1], (subs[0]["bn1.bias"][:1] + subs[1]["bn1.bias"] + subs[2]["bn1.bias"]) / 3
    )
    assert torch.allclose(new["bn1.bias"][1], subs[0]["bn1.bias"][1])
    # sample weights, when asked for
    weighted = aggregate(previous, subs, plans, weights=[1.0, 2.0, 5.0])
    assert torch.allclose(weighted["conv2.weight"][:2, :1], (s[0][:2, :1] + 2 * s[1] + 5 * s[2]) / 8)
    assert torch.allclose(weighted["conv2.weight"][2:4, :2], s[0][2:4, :2])


def test_rolling_aggregation_puts_elements_back_where_they_came_from():
    previous, plans, subs = _cnn_states([0.5, 0.25], "rolling", rnd=7)
    new = aggregate(previous, subs, plans)
    rows0, cols0 = plans[0]["conv2.weight"][:2]
    rows1, cols1 = plans[1]["conv2.weight"][:2]
    assert rows1.tolist() == [6, 7] and cols1.tolist() == [2]
    both = (
        subs[0]["conv2.weight"][rows0.tolist().index(6)][cols0.tolist().index(2)] + subs[1]["conv2.weight"][0][0]
    ) / 2
    assert torch.allclose(new["conv2.weight"][6, 2], both)
    assert torch.equal(new["conv2.weight"][2, 0], previous["conv2.weight"][2, 0])  # row 2 is in no window
    values, mask = embed(subs[0], plans[0], {k: v.shape for k, v in previous.items()})
    assert int(mask["conv2.weight"].sum()) == subs[0]["conv2.weight"].numel()
    assert torch.equal(
        values["conv2.weight"][mask["conv2.weight"]].sort().values, subs[0]["conv2.weight"].flatten().sort().values
    )


def test_classifier_rows_only_from_clients_holding_the_class():
    previous, plans, subs = _cnn_states([1.0, 0.5])
    holds = np.zeros((2, 10), dtype=bool)
    holds[0, [0, 1]] = True  # full-width client: classes 0, 1
    holds[1, [1, 2]] = True  # half-width client: classes 1, 2
    new = aggregate(previous, subs, plans, class_holds=holds, classifier_keys=["fc.weight", "fc.bias"])
    a, b, p = subs[0]["fc.weight"], subs[1]["fc.weight"], previous["fc.weight"]  # (10, 32), (10, 16)
    assert torch.allclose(new["fc.weight"][0], a[0])  # only the client holding class 0
    assert torch.allclose(new["fc.weight"][1, :16], (a[1, :16] + b[1]) / 2)
    assert torch.allclose(new["fc.weight"][1, 16:], a[1, 16:])
    assert torch.allclose(new["fc.weight"][2, :16], b[2]) and torch.equal(new["fc.weight"][2, 16:], p[2, 16:])
    assert torch.equal(new["fc.weight"][3:], p[3:])  # nobody holds classes 3..9
    assert torch.allclose(
        new["fc.bias"][:3],
        torch.stack(
            [subs[0]["fc.bias"][0], (subs[0]["fc.bias"][1] + subs[1]["fc.bias"][1]) / 2, subs[1]["fc.bias"][2]]
        ),
    )
    assert torch.equal(new["fc.bias"][3:], previous["fc.bias"][3:])
    # hidden layers are not per class: both clients count
    assert torch.allclose(
        new["conv4.weight"][0, 0], (subs[0]["conv4.weight"][0, 0] + subs[1]["conv4.weight"][0, 0]) / 2
    )


def test_aggregation_refuses_shapes_that_do_not_match_the_plan():
    previous, plans, subs = _cnn_states([0.5])
    bad = dict(subs[0])
    bad["conv2.weight"] = torch.zeros(8, 4, 3, 3)
    with pytest.raises(ValueError, match=r"conv2\.weight"):
        aggregate(previous, [bad], plans)


# ---------------------------------------------------------------- Scaler


def _capture(model, names):
    seen = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, i, o, n=n: seen.__setitem__(n, (i[0].detach().clone(), o.detach().clone()))
        )
        for n in names
    ]
    return seen, hooks


@pytest.mark.parametrize(
    "spec,conv,norm",
    [
        (CNN4, "conv2", "bn2"),
        ({**R18, "width": 8, "image_size": 8}, "layer2.0.shortcut.0", "layer2.0.shortcut.1"),
        ({**R18, "width": 8, "image_size": 8}, "layer3.1.conv2", "layer3.1.bn2"),
    ],
)
def test_scaler_divides_by_the_rate_before_each_norm_in_training_only(spec, conv, norm):
    rate = 0.25
    scaled = build_model(submodel_spec(spec, rate, scaler=True))
    plain = build_model(submodel_spec(spec, rate, scaler=False))
    plain.load_state_dict(scaled.state_dict())
    assert isinstance(scaled.scaler, Scaler) and not isinstance(plain.scaler, Scaler)
    x = torch.randn(4, spec["in_channels"], spec["image_size"], spec["image_size"])
    seen, hooks = _capture(scaled, [conv, norm])
    scaled.train()
    scaled(x)
    assert torch.allclose(seen[norm][0], seen[conv][1] / rate)  # training: norm input = conv output / rate
    scaled.eval()
    out_eval = scaled(x)
    assert torch.equal(seen[norm][0], seen[conv][1])  # evaluation: identity
    for h in hooks:
        h.remove()
    plain.eval()
    assert torch.equal(out_eval, plain(x))  # evaluation: the same model as without a Scaler
    scaled.train(), plain.train()
    assert not torch.equal(scaled(x), plain(x))  # training: not the same computation
