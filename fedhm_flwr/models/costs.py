"""Model costs: trainable parameters and multiply-accumulates (MACs) of one forward pass."""

from __future__ import annotations

from typing import Any

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
    return forward_counts(model, input_shape)[0]


def activation_elements(model: Any, input_shape: tuple[int, ...]) -> int:
    """Values one input leaves for the backward pass: the outputs of every leaf module, summed.

    Counted with forward hooks on a batch of 2 (eval mode, ``no_grad``; hooks and modes are
    restored); the per-input count is returned.
    """
    return forward_counts(model, input_shape)[1]


def forward_counts(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(:func:`count_macs`, :func:`activation_elements`) of one input, from ONE hooked forward pass on a
    batch of 2 in the dtype and on the device of the model's parameters (a model on the meta device
    runs every operation through Python decompositions: one pass instead of two halves a cost count)."""
    macs = activations = 0

    def on_conv(module: nn.Conv2d, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal macs
        macs += conv_macs(module, output[0].numel())

    def on_linear(module: nn.Linear, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal macs
        macs += output[0].numel() * module.in_features

    def on_leaf(_module: Any, _inputs: Any, output: Any) -> None:
        nonlocal activations
        if isinstance(output, torch.Tensor):
            activations += output.numel() // 2

    hooks = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            hooks.append(module.register_forward_hook(on_conv))
        elif isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(on_linear))
        if next(module.children(), None) is None:
            hooks.append(module.register_forward_hook(on_leaf))
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
    return macs, activations


def training_memory_bytes(
    params: int, activations_per_input: int, batch_size: int, optimizer_slots: int = 1, bytes_per_value: int = 4
) -> int:
    """Estimated memory of local training (float32): what a ``capability-memory`` budget is compared with.

    ``(2 + optimizer_slots) * params`` values for weights, gradients and optimizer buffers
    (SGD with momentum: one buffer; without: none) plus ``batch_size * activations_per_input``
    values of activations kept for the backward pass (:func:`activation_elements`). Not counted:
    the framework itself (Python, torch: a few hundred MB), the data set, the input batch and
    temporary workspaces, so a device should declare the memory it can give to the model.
    """
    return int(bytes_per_value * ((2 + optimizer_slots) * params + batch_size * activations_per_input))


def model_costs(model: nn.Module, shape: tuple[int, ...], batch_size: int, momentum: float) -> dict[str, float]:
    """A fully trained model's costs: ``params`` (trainable), ``macs`` (one input of ``shape``),
    ``bytes`` (float32 payload, ``4 · params``) and ``memory`` (estimated training memory at
    ``batch_size``, one optimizer slot with momentum: :func:`training_memory_bytes`)."""
    params = count_parameters(model)
    slots = 1 if float(momentum) > 0 else 0
    macs, activations = forward_counts(model, shape)
    return {
        "params": float(params),
        "macs": float(macs),
        "bytes": float(4 * params),
        "memory": float(training_memory_bytes(params, activations, int(batch_size), slots)),
    }
