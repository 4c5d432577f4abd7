"""HeteroFL's conv net for (Fashion-)MNIST-sized images, with static batch norm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from fedhm_flwr.math.width import scaled_channels

from .layers import make_scaler
from .rules import FactorizeRule, select_layers


def sbn(channels: int) -> nn.BatchNorm2d:
    """Static batch norm (sBN): affine, no running statistics (batch statistics always)."""
    return nn.BatchNorm2d(channels, track_running_stats=False)


class CNN(nn.Module):
    """``conv{i} -> bn{i} -> ReLU (-> MaxPool2d(2) for i < 4)`` for i = 1..4, global average
    pooling, ``fc``. Hidden sizes ``[w, 2w, 4w, 8w]`` (HeteroFL: ``w = 64``).

    The forward pools before the ReLU (``relu_after_pool``): max-pooling and ReLU commute exactly
    (both monotone; same outputs, same gradients, bit for bit), and the ReLU then runs on a
    quarter of the elements (about 4 % of a training step at width 16 on a CPU: bench figure 3).

    ``conv1`` is the stem and is never factorized; of ``conv2..conv4`` the first
    ``default_rho = 1`` (``conv2``) stays full rank by default.

    ``width_rate`` < 1 builds HeteroFL's sub-model: each hidden size ``C`` becomes
    ``ceil(width_rate · C)``; ``scaler`` puts the Scaler (``x / width_rate`` in training) before
    every norm. The state dict keys do not change.
    """

    default_rho: int = 1
    #: ``bn -> MaxPool2d -> ReLU`` (False: ``bn -> ReLU -> MaxPool2d``, the same function, slower)
    relu_after_pool: bool = True
    #: the stem ``conv1`` is never factorized (nor ``fc``, the head, by the default rule)
    factorize_rule = FactorizeRule(exclude=("conv1",), pointwise=False)

    def __init__(
        self, num_classes: int, in_channels: int = 1, width: int = 64, width_rate: float = 1.0, scaler: bool = False
    ) -> None:
        super().__init__()
        hidden = [scaled_channels(c, width_rate) for c in (width, 2 * width, 4 * width, 8 * width)]
        self.hidden = hidden
        prev = in_channels
        for i, h in enumerate(hidden, start=1):
            setattr(self, f"conv{i}", nn.Conv2d(prev, h, 3, 1, 1, bias=False))
            setattr(self, f"bn{i}", sbn(h))
            prev = h
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(hidden[-1], num_classes)
        self.scaler = make_scaler(width_rate, scaler)

    def factorizable_layers(self) -> list[str]:
        """Layers that may be factorized, in forward order (stem and classifier excluded): what
        the model's rule selects (:func:`fedhm_flwr.models.rules.select_layers`)."""
        return select_layers(self)

    def forward(self, x: Tensor) -> Tensor:
        last = len(self.hidden)
        for i in range(1, last + 1):
            x = getattr(self, f"bn{i}")(self.scaler(getattr(self, f"conv{i}")(x)))
            if i == last:
                x = self.relu(x)
            else:
                x = self.relu(self.pool(x)) if self.relu_after_pool else self.pool(self.relu(x))
        return self.fc(self.avgpool(x).flatten(1))


def build_cnn(spec: Mapping[str, Any]) -> CNN:
    """Registry builder: ``num_classes``, ``in_channels``, optional ``width`` (64), ``width_rate`` (1),
    ``scaler`` (false)."""
    return CNN(
        int(spec["num_classes"]),
        int(spec["in_channels"]),
        int(spec.get("width", 64)),
        float(spec.get("width_rate", 1.0)),
        bool(spec.get("scaler", False)),
    )
