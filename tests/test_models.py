"""Models and costs: shapes, the paper's Table 2 parameter counts, MACs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhm_flwr.models import ARCHS, build_model, count_macs, count_parameters, input_shape
from fedhm_flwr.models.layers import FactorizedConv2d
from fedhm_flwr.models.rules import plan_ranks

R18 = {"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32}
R34 = {"arch": "resnet34", "num_classes": 100, "in_channels": 3, "image_size": 32}


def _level_params(spec, gamma):
    """Parameters of the hybrid model of level ``gamma`` (default rho), built from its spec.

    Built on the meta device: shapes only, no memory or initialisation cost.
    """
    with torch.device("meta"):
        ranks = plan_ranks(build_model(spec), gamma)
        return count_parameters(build_model({**spec, "ranks": ranks}, spectral_init=False))


def test_resnet18_cifar_is_the_standard_one():
    with torch.device("meta"):  # shapes only
        model = build_model(R18)
    assert count_parameters(model) == 11_173_962
    assert not any("running" in key or "num_batches" in key for key in model.state_dict())
    assert model.default_rho == 2 and len(model.factorizable_layers()) == 16


@pytest.mark.parametrize(
    "spec,gamma,millions",
    [
        (R18, 1, 11.17),
        (R18, 1 / 2, 4.16),
        (R18, 1 / 4, 2.21),
        (R18, 1 / 8, 1.24),
        (R34, 1, 21.33),
        (R34, 1 / 2, 8.40),
        (R34, 1 / 4, 4.99),
        (R34, 1 / 8, 3.28),  # docs/METHODS.md#fedhm-hybrid; the paper's Table 2 prints 3.27 (3,277,220 truncated)
        (R34, 1 / 12, 2.71),
    ],
)
def test_table2_parameter_counts(spec, gamma, millions):
    assert round(_level_params(spec, gamma) / 1e6, 2) == millions


def test_resnet34_keeps_layer1_and_layer2_full():
    with torch.device("meta"):  # shapes only
        model = build_model(R34)
    plan = plan_ranks(model, 1 / 2)
    assert model.default_rho == 14
    assert min(plan, key=list(model.factorizable_layers()).index) == "layer3.0.conv1"
    assert not any(name.startswith(("layer1", "layer2")) for name in plan)


def test_factorized_macs_below_full_and_decreasing():
    spec = {**R18, "width": 8}
    full = build_model(spec)
    macs = [count_macs(full, input_shape(spec))]
    for gamma in (1 / 2, 1 / 4, 1 / 8):
        hybrid = build_model({**spec, "ranks": plan_ranks(full, gamma)}, spectral_init=False)
        macs.append(count_macs(hybrid, input_shape(spec)))
    assert macs == sorted(macs, reverse=True) and len(set(macs)) == 4


def test_count_macs_closed_forms_and_restores_mode():
    conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)  # 16x16 -> 8x8
    assert count_macs(conv, (3, 16, 16)) == 8 * 8 * 8 * (3 * 3 * 3)
    lin = nn.Linear(20, 7)
    assert count_macs(lin, (20,)) == 20 * 7
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 2),
    )
    model.train()
    model[1].eval()
    assert count_macs(model, (3, 5, 5)) == 4 * 25 * 27 + 100 * 2
    assert model.training and model[0].training and not model[1].training
    assert not model._forward_hooks and not model[0]._forward_hooks and not model[3]._forward_hooks
    # A factorized conv costs r*k*(m+n)*HW (Table 1) at stride 1.
    fact = FactorizedConv2d(16, 32, 3, rank=4, padding=1)
    assert count_macs(fact, (16, 10, 10)) == 4 * 3 * (16 + 32) * 100


@pytest.mark.parametrize(
    "spec",
    [
        {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 8},
        {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28},
        {"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32, "width": 8},
        {"arch": "resnet34", "num_classes": 100, "in_channels": 3, "image_size": 32, "width": 8},
    ],
)
def test_output_shapes(spec):
    full = build_model(spec)
    x = torch.randn(2, *input_shape(spec))
    assert full(x).shape == (2, spec["num_classes"])
    # Spectral init (SVDs of the random weights) only on the small models, to keep the test fast.
    small = spec.get("width", 64) <= 8 and spec["arch"] != "resnet34"
    hybrid = build_model({**spec, "ranks": plan_ranks(full, 1 / 4)}, spectral_init=small)
    assert hybrid(x).shape == (2, spec["num_classes"])


def test_cnn_layout():
    model = build_model({"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28})
    assert [model.get_submodule(f"conv{i}").out_channels for i in range(1, 5)] == [64, 128, 256, 512]
    assert model.factorizable_layers() == ["conv2", "conv3", "conv4"]
    assert model.default_rho == 1
    assert list(plan_ranks(model, 1 / 2)) == ["conv3", "conv4"]
    assert all(model.get_submodule(f"conv{i}").bias is None for i in range(1, 5))


@pytest.mark.parametrize("extra", [{}, {"ranks": {"conv3": 2, "conv4": 3}}, {"width_rate": 0.5, "scaler": True}])
def test_cnn_pools_before_relu_with_the_same_outputs_and_gradients_bit_for_bit(extra):
    """The CNN's ``bn -> MaxPool -> ReLU`` is ``bn -> ReLU -> MaxPool`` exactly (outputs and every
    gradient ``torch.equal``), ties inside pooling windows included (constant images)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = (
        build_model(
            {"arch": "cnn", "num_classes": 5, "in_channels": 1, "image_size": 12, "width": 4, **extra},
            spectral_init=False,
        )
        .train()
        .to(memory_format=torch.channels_last)
    )
    assert model.relu_after_pool

    def reference(x):  # the HeteroFL layout, written out: conv, norm, ReLU, then pool
        for i in range(1, 5):
            x = F.relu(model.get_submodule(f"bn{i}")(model.scaler(model.get_submodule(f"conv{i}")(x))))
            x = F.max_pool2d(x, 2) if i < 4 else x
        return model.fc(x.mean((2, 3)))

    x = torch.cat([torch.randn(4, 1, 12, 12), torch.full((2, 1, 12, 12), 0.5), torch.zeros(2, 1, 12, 12)])
    x = x.contiguous(memory_format=torch.channels_last)
    results = []
    for forward in (model, reference):
        model.zero_grad(set_to_none=True)
        out = forward(x)
        F.cross_entropy(out, torch.arange(8) % 5).backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (out, grads), (ref_out, ref_grads) = results
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_unknown_arch_refused():
    assert {"cnn", "resnet18", "resnet34"} <= set(ARCHS)
    with pytest.raises(ValueError, match="arch"):
        build_model({"arch": "vgg", "num_classes": 10, "in_channels": 3, "image_size": 32})
