"""The torch Dataset of image partitions: normalised float32 NCHW tensors, CIFAR augmentation."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from fedhm_flwr.data.catalog import DatasetInfo


def to_normalised_tensor(images: np.ndarray, info: DatasetInfo) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW, ``(x / 255 - mean) / std`` per channel."""
    # astype copies (the cached arrays are read-only); then in place, one buffer.
    x = torch.from_numpy(images.transpose(0, 3, 1, 2).astype(np.float32, order="C"))
    mean = torch.tensor(info.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(info.std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.div_(255.0).sub_(mean).div_(std)


def _train_augmentation(info: DatasetInfo) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """CIFAR and the folder sources: random crop (pad 1/8 of the size: 4 at 32) + horizontal flip on a
    normalised CHW tensor."""
    if info.name not in ("cifar10", "cifar100", "imagefolder", "hf_disk"):
        return None
    from torchvision.transforms import v2

    # Pad with black (pixel value 0) as the usual pre-normalisation pipeline does.
    fill = [float(-m / s) for m, s in zip(info.mean, info.std)]
    return v2.Compose(
        [
            v2.RandomCrop(info.image_size, padding=max(1, info.image_size // 8), fill=fill),
            v2.RandomHorizontalFlip(),
        ]
    )


class ImageTensorDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """In-memory image classification dataset.

    Attributes: ``images`` (float32 NCHW, normalised), ``labels`` (int64, shape (N,)),
    ``num_classes``, ``transform`` (per-sample callable on a CHW tensor, or None).
    ``__getitem__`` returns ``(image CHW float32, label 0-dim int64 tensor)``.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        num_classes: int,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError("images and labels differ in length")
        self.images = images
        self.labels = labels
        self.num_classes = num_classes
        self.transform = transform

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.labels[i]

    def label_array(self) -> np.ndarray:
        """Labels as an int64 numpy array."""
        return self.labels.numpy()

    def class_counts(self) -> np.ndarray:
        """Examples per class, length ``num_classes``."""
        return np.bincount(self.label_array(), minlength=self.num_classes)


def image_dataset(
    images: np.ndarray, labels: np.ndarray, info: DatasetInfo, augment: bool = False
) -> ImageTensorDataset:
    """uint8 NHWC images + labels -> normalised :class:`ImageTensorDataset` (CIFAR augmentation
    when ``augment``); shared by the simulation's partitions and the nodes' shards."""
    return ImageTensorDataset(
        to_normalised_tensor(images, info),
        torch.from_numpy(np.array(labels, dtype=np.int64)),
        info.num_classes,
        _train_augmentation(info) if augment else None,
    )
