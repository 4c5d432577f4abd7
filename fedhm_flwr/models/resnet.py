"""CIFAR-style ResNet-18/34 (3×3 stem, stride 1, no max-pool) with static batch norm."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from .cnn import sbn


class BasicBlock(nn.Module):
    """Two 3×3 convs with sBN; ``shortcut`` = 1×1 conv + sBN when the shape changes."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = sbn(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = sbn(planes)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), sbn(planes))
        else:
            self.shortcut = nn.Sequential()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: stem ``conv1``/``bn1``, ``layer1..layer4`` (widths w, 2w, 4w, 8w; strides
    1, 2, 2, 2), global average pooling, ``fc``.

    ``factorizable_layers()`` lists every block's ``conv1``/``conv2`` in forward order (never the
    stem, the 1×1 shortcuts or ``fc``); the first ``default_rho`` of them stay full rank.
    """

    def __init__(
        self,
        num_blocks: list[int],
        num_classes: int,
        in_channels: int = 3,
        width: int = 64,
        default_rho: int = 0,
    ) -> None:
        super().__init__()
        self.default_rho = default_rho
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = sbn(width)
        self.relu = nn.ReLU(inplace=True)
        in_planes = width
        for stage, (blocks, stride) in enumerate(zip(num_blocks, (1, 2, 2, 2)), start=1):
            planes = width * 2 ** (stage - 1)
            layers = []
            for b in range(blocks):
                layers.append(BasicBlock(in_planes, planes, stride if b == 0 else 1))
                in_planes = planes
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)

    def factorizable_layers(self) -> list[str]:
        """Block convs ``layerX.Y.conv1``, ``layerX.Y.conv2`` in forward order."""
        names = []
        for stage in range(1, 5):
            for b in range(len(getattr(self, f"layer{stage}"))):
                names += [f"layer{stage}.{b}.conv1", f"layer{stage}.{b}.conv2"]
        return names

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(num_classes: int, in_channels: int = 3, width: int = 64) -> ResNet:
    """ResNet-18; ``layer1.0`` stays full rank by default (``default_rho = 2``)."""
    return ResNet([2, 2, 2, 2], num_classes, in_channels, width, default_rho=2)


def resnet34(num_classes: int, in_channels: int = 3, width: int = 64) -> ResNet:
    """ResNet-34; ``layer1`` and ``layer2`` stay full rank by default (``default_rho = 6 + 8``)."""
    return ResNet([3, 4, 6, 3], num_classes, in_channels, width, default_rho=14)


def build_resnet18(spec: Mapping) -> ResNet:
    """Registry builder: ``num_classes``, ``in_channels``, optional ``width`` (64)."""
    return resnet18(int(spec["num_classes"]), int(spec["in_channels"]), int(spec.get("width", 64)))


def build_resnet34(spec: Mapping) -> ResNet:
    """Registry builder: ``num_classes``, ``in_channels``, optional ``width`` (64)."""
    return resnet34(int(spec["num_classes"]), int(spec["in_channels"]), int(spec.get("width", 64)))
