"""The dataset registry (shapes, classes, normalisation), the per-process caches, and
:func:`load_arrays`, which reads a whole split of a built-in dataset (``idx``, ``cifar``)."""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.data.files import DATA_DIR_ENV

# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts about a dataset: shape, classes and normalisation constants."""

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_train: int
    num_test: int


DATASETS: dict[str, DatasetInfo] = {
    # Mean/std measured on the respective training sets (true per-channel std, so that
    # normalised data has std ~1; the often-quoted CIFAR std (0.2023, ...) is not that).
    "fashion_mnist": DatasetInfo(
        "fashion_mnist", 10, 1, 28, (0.2860,), (0.3530,), 60000, 10000
    ),
    "cifar10": DatasetInfo(
        "cifar10", 10, 3, 32,
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 50000, 10000,
    ),
    "cifar100": DatasetInfo(
        "cifar100", 100, 3, 32,
        (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 50000, 10000,
    ),
}

#: datasets served by another module with the same entry points (``dataset_info``,
#: ``client_dataset``, ``test_dataset``) and the same data specs: name -> module.
EXTERNAL_DATASETS: dict[str, str] = {"sentiment": "fedhm_flwr.data.text"}


def _external(name: Any) -> Any:
    """The module serving dataset ``name`` when it is not an image dataset of this file."""
    module = EXTERNAL_DATASETS.get(name) if isinstance(name, str) else None
    return importlib.import_module(module) if module else None

SPLITS: tuple[str, ...] = ("train", "test")


def _info(name: Any) -> DatasetInfo:
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(
            f"dataset.name: unknown dataset {name!r}; allowed values: {sorted(DATASETS)}"
        )
    return DATASETS[name]


def dataset_info(name: str) -> dict[str, int]:
    """Return ``{"num_classes", "in_channels", "image_size"}`` of dataset ``name``.

    Exactly these three keys, so that it can be splatted into a model builder.
    Raises ValueError naming ``dataset.name`` for an unknown dataset.
    """
    external = _external(name)
    if external is not None:
        return external.dataset_info(name)
    info = _info(name)
    return {
        "num_classes": info.num_classes,
        "in_channels": info.in_channels,
        "image_size": info.image_size,
    }


# --------------------------------------------------------------------------- caches

_LOCK = threading.RLock()
_ARRAY_CACHE: dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]] = {}
_PARTITION_CACHE: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = {}


def clear_caches() -> None:
    """Forget every array and partition cached in this process (tests, memory)."""
    with _LOCK:
        _ARRAY_CACHE.clear()
        _PARTITION_CACHE.clear()


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _resolved_key(data_dir: str | os.PathLike[str] | None) -> str:
    """Cache key for a data location (explicit dir, or the env/system fallback)."""
    if data_dir is not None:
        return str(Path(data_dir).expanduser().resolve())
    return "env:" + os.environ.get(DATA_DIR_ENV, "")


def load_arrays(
    name: str,
    split: str,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Load a whole split as ``(images uint8 NHWC (N, H, W, C), labels int64 (N,))``.

    ``split`` is "train" or "test". Cached per process (read-only arrays; copy
    before modifying). Raises FileNotFoundError with a remedy when the files are
    missing; CIFAR is only downloaded when ``download`` is true.
    """
    info = _info(name)
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed values: {list(SPLITS)}")
    key = (name, split, _resolved_key(data_dir))
    with _LOCK:
        hit = _ARRAY_CACHE.get(key)
        if hit is not None:
            return hit
        d = None if data_dir is None else str(data_dir)
        if name == "fashion_mnist":
            from fedhm_flwr.data.idx import _load_fashion_mnist

            images, labels = _load_fashion_mnist(split, d)
        else:
            from fedhm_flwr.data.cifar import _load_cifar

            images, labels = _load_cifar(name, split, d, download)
        if images.shape[1:] != (info.image_size, info.image_size, info.in_channels):
            raise ValueError(f"{name}/{split}: unexpected image shape {images.shape}")
        out = (_readonly(images), _readonly(labels))
        _ARRAY_CACHE[key] = out
        return out
