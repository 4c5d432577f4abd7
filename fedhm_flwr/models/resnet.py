"""CIFAR-style ResNet-18/34 (3×3 stem, stride 1, no max-pool) with static batch norm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from fedhm_flwr.math.width import scaled_channels

from .cnn import sbn
from .layers import make_scaler
from .rules import FactorizeRule, select_layers


class BasicBlock(nn.Module):
    """Two 3×3 convs with sBN; ``shortcut`` = 1×1 conv + sBN when the shape changes.

    ``downsample`` (default: whether the shape changes) forces the 1×1 shortcut: a width-sliced
    sub-model keeps the full model's shortcuts even where its sliced widths happen to coincide.
    ``scaler`` (HeteroFL's Scaler, or identity) runs right before every norm.
    """

    def __init__(
        self,
        in_planes: int,
        planes: int,
        stride: int = 1,
        downsample: bool | None = None,
        scaler: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.scaler = scaler if scaler is not None else nn.Identity()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = sbn(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = sbn(planes)
        self.relu = nn.ReLU(inplace=True)
        if downsample if downsample is not None else (stride != 1 or in_planes != planes):
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), sbn(planes))
        else:
            self.shortcut = nn.Sequential()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.scaler(self.conv1(x))))
        out = self.bn2(self.scaler(self.conv2(out)))
        if len(self.shortcut):
            conv, norm = self.shortcut
            x = norm(self.scaler(conv(x)))
        return self.relu(out + x)


class ResNet(nn.Module):
    """CIFAR ResNet: stem ``conv1``/``bn1``, ``layer1..layer4`` (widths w, 2w, 4w, 8w; strides
    1, 2, 2, 2), global average pooling, ``fc``.

    ``factorizable_layers()`` lists every block's ``conv1``/``conv2`` in forward order (never the
    stem, the 1×1 shortcuts or ``fc``); the first ``default_rho`` of them stay full rank.

    The rule (:mod:`fedhm_flwr.models.rules`) excludes the stem; the 1×1 shortcuts and the head
    are left full by the default rule.

    ``width_rate`` < 1 builds HeteroFL's sub-model: every hidden width ``C`` (stem included)
    becomes ``ceil(width_rate · C)`` of the full model's, with the full model's shortcuts;
    ``scaler`` adds the Scaler before every norm. The state dict keys do not change.
    """

    factorize_rule = FactorizeRule(exclude=("conv1",), pointwise=False)
    layer1: nn.Sequential  # (set by name in __init__'s loop over the stages)
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential

    def __init__(
        self,
        num_blocks: list[int],
        num_classes: int,
        in_channels: int = 3,
        width: int = 64,
        default_rho: int = 0,
        width_rate: float = 1.0,
        scaler: bool = False,
    ) -> None:
        super().__init__()
        self.default_rho = default_rho
        self.scaler = make_scaler(width_rate, scaler)
        self.conv1 = nn.Conv2d(in_channels, scaled_channels(width, width_rate), 3, 1, 1, bias=False)
        self.bn1 = sbn(scaled_channels(width, width_rate))
        self.relu = nn.ReLU(inplace=True)
        full_in = width  # the full model's widths decide where the shortcuts are
        for stage, (blocks, stride) in enumerate(zip(num_blocks, (1, 2, 2, 2)), start=1):
            full_planes = width * 2 ** (stage - 1)
            layers = []
            for b in range(blocks):
                s = stride if b == 0 else 1
                layers.append(
                    BasicBlock(
                        scaled_channels(full_in, width_rate),
                        scaled_channels(full_planes, width_rate),
                        s,
                        s != 1 or full_in != full_planes,
                        self.scaler,
                    )
                )
                full_in = full_planes
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(scaled_channels(full_in, width_rate), num_classes)

    def factorizable_layers(self) -> list[str]:
        """Block convs ``layerX.Y.conv1``, ``layerX.Y.conv2`` in forward order (the rule's selection)."""
        return select_layers(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.scaler(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(
    num_classes: int, in_channels: int = 3, width: int = 64, width_rate: float = 1.0, scaler: bool = False
) -> ResNet:
    """ResNet-18; ``layer1.0`` stays full rank by default (``default_rho = 2``)."""
    return ResNet([2, 2, 2, 2], num_classes, in_channels, width, default_rho=2, width_rate=width_rate, scaler=scaler)


def resnet34(
    num_classes: int, in_channels: int = 3, width: int = 64, width_rate: float = 1.0, scaler: bool = False
) -> ResNet:
    """ResNet-34; ``layer1`` and ``layer2`` stay full rank by default (``default_rho = 6 + 8``)."""
    return ResNet([3, 4, 6, 3], num_classes, in_channels, width, default_rho=14, width_rate=width_rate, scaler=scaler)


def _options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Builder arguments of a spec: ``width`` (64), ``width_rate`` (1), ``scaler`` (false)."""
    return {
        "width": int(spec.get("width", 64)),
        "width_rate": float(spec.get("width_rate", 1.0)),
        "scaler": bool(spec.get("scaler", False)),
    }


def build_resnet18(spec: Mapping[str, Any]) -> ResNet:
    """Registry builder: ``num_classes``, ``in_channels``, optional ``width``, ``width_rate``, ``scaler``."""
    return resnet18(int(spec["num_classes"]), int(spec["in_channels"]), **_options(spec))


def build_resnet34(spec: Mapping[str, Any]) -> ResNet:
    """Registry builder: ``num_classes``, ``in_channels``, optional ``width``, ``width_rate``, ``scaler``."""
    return resnet34(int(spec["num_classes"]), int(spec["in_channels"]), **_options(spec))
