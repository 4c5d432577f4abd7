"""Static batch norm statistics without moving data (docs/METHODS.md#static-bn). No Flower import.

Training uses batch statistics only (the models' norms track nothing). For evaluation the server
asks clients to run a model over their local training data and return, per normalisation layer,
the per-channel sum and sum of squares of the layer's input and the number of values summed
(:func:`bn_sums`); it adds the clients' sums (:func:`combine_bn_sums`) and installs
``mean = S / N``, ``var = SS / N - mean^2`` as the layers' statistics (:func:`apply_bn_statistics`).
The pass runs in training mode (every layer normalises with its batch statistics, as in client
training), so the statistics are those the layers see during training, as in HeteroFL's sBN;
modules that act in training only (``training_only = True``, HeteroFL's Scaler) are switched off
for the pass, so the statistics describe what the norms see in evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

Sums = dict[str, torch.Tensor]  # "<layer>.sum", "<layer>.sumsq" (per channel), "<layer>.count" (scalar)


def norm_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """The norm layers that normalise with the batch's own statistics in eval mode too (static
    BN, ``track_running_stats=False``): a model holding any predicts by batch composition until
    fixed statistics are installed (:func:`apply_bn_statistics`)."""
    return [n for n, m in norm_layers(model).items() if not m.track_running_stats]


def fixed_bn(model: nn.Module) -> nn.Module:
    """Give every static norm layer running-statistics buffers (mean 0, variance 1, filled by a
    state dict loaded next) and let eval mode use them: the structure of a model whose fixed
    statistics were installed by :func:`apply_bn_statistics`, for loading its state dict."""
    layers = norm_layers(model)
    for name in batch_statistics_layers(model):
        layer = layers[name]
        device = next((p.device for p in layer.parameters()), None)
        layer.register_buffer("running_mean", torch.zeros(layer.num_features, device=device))
        layer.register_buffer("running_var", torch.ones(layer.num_features, device=device))
        layer.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        layer.track_running_stats = True
    return model


@torch.no_grad()
def bn_sums(model: nn.Module, dataset: Dataset[Any], batch_size: int, device: torch.device) -> Sums:
    """Per-channel sums, sums of squares and counts of every norm layer's input over ``dataset``."""
    layers = norm_layers(model)
    acc: Sums = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().to(torch.float64)
            dims = [d for d in range(x.dim()) if d != 1]
            s, ss = x.sum(dim=dims), (x * x).sum(dim=dims)
            n = torch.tensor(float(x.numel() // x.shape[1]), dtype=torch.float64)
            for key, value in ((f"{name}.sum", s), (f"{name}.sumsq", ss), (f"{name}.count", n)):
                acc[key] = acc[key] + value.cpu() if key in acc else value.cpu()

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    was_training = model.training
    try:
        model.to(device).train()
        for module in model.modules():  # e.g. HeteroFL's Scaler: off, as in evaluation
            if getattr(module, "training_only", False):
                module.eval()
        for x in _batches(dataset, batch_size):
            model(x.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return acc


def _batches(dataset: Dataset[Any], batch_size: int) -> Iterable[torch.Tensor]:
    """The inputs in order, in batches of ``batch_size``; a last batch of one example joins the
    batch before it (a norm layer in training mode cannot normalise a single value per channel),
    so every example counts."""
    pending = None
    for x, _ in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        if pending is not None:
            if len(x) == 1:
                x = torch.cat([pending, x])
            else:
                yield pending
        pending = x
    if pending is not None:
        yield pending


def combine_bn_sums(parts: Iterable[Mapping[str, torch.Tensor]]) -> Sums:
    """Add the clients' sums (what the server does with the replies)."""
    total: Sums = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total[key] + value.to(torch.float64) if key in total else value.to(torch.float64).clone()
    return total


def statistics(sums: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (mean, biased variance) from combined sums."""
    out = {}
    for key in sums:
        if key.endswith(".count"):
            name = key[: -len(".count")]
            n = sums[key]
            mean = sums[f"{name}.sum"] / n
            var = (sums[f"{name}.sumsq"] / n - mean * mean).clamp_min(0.0)
            out[name] = (mean, var)
    return out


def apply_bn_statistics(model: nn.Module, sums: Mapping[str, torch.Tensor]) -> nn.Module:
    """Install the statistics as the norm layers' running statistics (used in eval mode)."""
    stats = statistics(sums)
    for name, layer in norm_layers(model).items():
        if name not in stats:
            raise KeyError(f"no statistics for norm layer {name!r}")
        mean, var = stats[name]
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        layer.running_mean = mean.to(device, torch.float32)
        layer.running_var = var.to(device, torch.float32)
        layer.num_batches_tracked = torch.tensor(1, device=device)
        layer.track_running_stats = True
    return model
