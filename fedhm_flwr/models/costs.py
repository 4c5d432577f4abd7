"""Model costs: trainable parameters and multiply-accumulates (MACs) of one forward pass."""

from __future__ import annotations

import torch
from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def conv_macs(conv: nn.Conv2d, out_elements: int) -> int:
    """MACs of a conv producing ``out_elements`` outputs: ``out · (in/groups) · kh · kw``."""
    kh, kw = conv.kernel_size
    return out_elements * (conv.in_channels // conv.groups) * kh * kw


def count_macs(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """MACs of one forward pass for ONE input of shape ``input_shape`` (without batch dim).

    Counted with forward hooks on every ``Conv2d`` (``out_elements · in/groups · kh · kw``) and
    ``Linear`` (``in · out`` per output row); normalisation, pooling and activations are not
    counted. The pass runs on a batch of 2 (sBN needs more than one value per channel) under
    ``no_grad``; the per-sample count is reported. The model's train/eval mode is restored and
    the hooks removed.
    """
    total = 0

    def on_conv(module: nn.Conv2d, _inputs, output: torch.Tensor) -> None:
        nonlocal total
        total += conv_macs(module, output[0].numel())

    def on_linear(module: nn.Linear, _inputs, output: torch.Tensor) -> None:
        nonlocal total
        total += output[0].numel() * module.in_features

    hooks = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            hooks.append(module.register_forward_hook(on_conv))
        elif isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(on_linear))
    modes = {module: module.training for module in model.modules()}
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((2, *input_shape), device=device, dtype=dtype))
    finally:
        for hook in hooks:
            hook.remove()
        for module, training in modes.items():
            module.training = training
    return total
