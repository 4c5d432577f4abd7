"""Torchvision models for grey images (the tests' Fashion-MNIST): ``model.target=tests.tv_models:grey``."""

from __future__ import annotations

import torchvision
from torch import nn


def grey(name: str, **kwargs) -> nn.Module:
    """``torchvision.models.<name>(weights=None, **kwargs)`` with its first convolution taking one channel."""
    model = getattr(torchvision.models, name)(weights=None, **kwargs)
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, child_name, nn.Conv2d(1, child.out_channels, child.kernel_size, child.stride,
                                                      child.padding, bias=child.bias is not None))
                return model
    raise ValueError(f"{name} has no convolution")
