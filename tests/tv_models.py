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
                setattr(
                    parent,
                    child_name,
                    nn.Conv2d(
                        1,
                        child.out_channels,
                        child.kernel_size,
                        child.stride,
                        child.padding,
                        bias=child.bias is not None,
                    ),
                )
                return model
    raise ValueError(f"{name} has no convolution")


class GroupNormCNN(nn.Module):
    """A user's CNN: GroupNorm (no running statistics) and a 1x1 convolutional head that the
    constructor registers before the body, so only what the forward does says it is the head."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 8) -> None:
        super().__init__()
        self.head = nn.Conv2d(2 * width, num_classes, 1)  # the logits, registered first
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.GroupNorm(2, width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.GroupNorm(2, 2 * width),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.GroupNorm(2, 2 * width),
            nn.ReLU(),
        )

    def forward(self, x):
        return self.head(self.body(x)).mean((2, 3))


def gn_cnn(**kwargs) -> nn.Module:
    """``model.target=tests.tv_models:gn_cnn``: :class:`GroupNormCNN`."""
    return GroupNormCNN(**kwargs)


class _Pair(GroupNormCNN):
    def forward(self, x):  # logits and an auxiliary output in training, as GoogLeNet's aux_logits
        logits = super().forward(x)
        return (logits, logits) if self.training else logits


def pair_cnn(**kwargs) -> nn.Module:
    """A model whose training forward returns a tuple (refused by the config check)."""
    return _Pair(**kwargs)


class _Unloadable(GroupNormCNN):
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if "extra" not in local_metadata:
            raise ValueError("this model needs its own metadata")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def unloadable_cnn(**kwargs) -> nn.Module:
    """A model that loads only a state dict carrying metadata no client receives (refused by the check)."""
    return _Unloadable(**kwargs)
