"""Local training details: which parameters get ordinary weight decay."""

from __future__ import annotations

import torch

from fedhm_flwr.math.train import parameter_groups
from fedhm_flwr.models.layers import FactorizedLinear


def test_frobenius_decay_spares_the_factor_weights_but_not_the_biases():
    model = torch.nn.Sequential(FactorizedLinear.from_linear(torch.nn.Linear(8, 6), rank=2), torch.nn.Linear(6, 3))
    groups = parameter_groups(model, weight_decay=0.01, frobenius_decay=True)
    decay = {id(p) for g in groups if g["weight_decay"] == 0.01 for p in g["params"]}
    none = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    low = model[0]
    assert none == {id(low.a.weight), id(low.b.weight)}  # the pair: Frobenius decay instead
    assert id(low.a.bias) in decay  # the factorized layer's bias is a full-rank parameter
    assert decay | none == {id(p) for p in model.parameters()} and not decay & none
    plain = parameter_groups(model, weight_decay=0.01, frobenius_decay=False)
    assert len(plain) == 1 and len(plain[0]["params"]) == len(list(model.parameters()))


def test_closed_form_frobenius_gradient_equals_autograd_of_the_penalty():
    """``backward`` gives every parameter the gradient of ``objective + λ/2 Σ‖AB‖_F²`` (conv and
    linear pairs, whatever the memory layout), without building the penalty's graph."""
    from fedhm_flwr.math.train import backward, conv_layout, frobenius_penalty
    from fedhm_flwr.models.layers import FactorizedConv2d

    torch.manual_seed(0)
    conv = FactorizedConv2d.from_conv(torch.nn.Conv2d(3, 8, 3, 2, 1, bias=True), rank=4)
    model = torch.nn.Sequential(
        conv, torch.nn.ReLU(), torch.nn.Flatten(), FactorizedLinear.from_linear(torch.nn.Linear(8 * 4 * 4, 5), rank=3)
    )
    assert conv_layout(model, torch.device("cpu")) == torch.channels_last
    x = torch.randn(4, 3, 8, 8)
    lam = 0.3  # large, so that the penalty's share of the gradient is far above float noise
    (torch.nn.functional.cross_entropy(model(x), torch.arange(4)) + frobenius_penalty(model, lam)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.to(memory_format=torch.channels_last)
    backward(
        torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), torch.arange(4)),
        model,
        lam,
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    model.zero_grad()
    backward(torch.nn.functional.cross_entropy(model(x), torch.arange(4)), model, 0.0)  # no decay: plain backward
    assert not torch.allclose(model[0].b.weight.grad, expected["0.b.weight"], rtol=1e-3)


def test_local_training_runs_channels_last_and_hands_back_a_plain_layout():
    from fedhm_flwr.math.train import TrainOptions, train_local
    from fedhm_flwr.models import build_model

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((1, 12, 12), float(i)), i % 3

    model = build_model(
        {
            "arch": "cnn",
            "num_classes": 3,
            "in_channels": 1,
            "image_size": 12,
            "width": 4,
            "ranks": {"conv3": 2, "conv4": 3},
        },
        spectral_init=False,
    )
    seen = []
    model.conv2.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    train_local(model, Data(), TrainOptions(batch_size=4, frobenius_decay=True), torch.device("cpu"))
    assert seen and all(seen)  # trained in channels_last
    assert all(t.is_contiguous() for t in model.state_dict().values())  # what travels back: plain layout


def test_a_strided_pointwise_conv_of_few_channels_trains_in_the_plain_layout():
    """oneDNN's AVX2 backward of a strided 1×1 conv with fewer than 8 input channels corrupts the
    heap in channels_last (torch 2.14, CPUs without AVX-512: a ResNet of width 2's downsampling
    aborted the process); such a model trains contiguous, any other conv model channels_last."""
    from fedhm_flwr.math.train import conv_layout

    cpu = torch.device("cpu")
    for channels, stride, kernel, layout in [
        (4, 2, 1, torch.contiguous_format),
        (7, (1, 2), 1, torch.contiguous_format),
        (8, 2, 1, torch.channels_last),
        (4, 1, 1, torch.channels_last),
        (4, 2, 3, torch.channels_last),
    ]:
        model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3), torch.nn.Conv2d(channels, 8, kernel, stride))
        assert conv_layout(model, cpu) == layout, (channels, stride, kernel)
