"""CIFAR-10/100 through torchvision's dataset classes (downloaded only when the spec allows it)."""

from __future__ import annotations

import numpy as np

from fedhm_flwr.data.files import CIFAR_ARCHIVES, CIFAR_FOLDERS, DATA_DIR_ENV, cifar_root


def load_cifar(name: str, split: str, data_dir: str | None, download: bool) -> tuple[np.ndarray, np.ndarray]:
    root = cifar_root(data_dir)
    folder = root / CIFAR_FOLDERS[name]
    if not download and not folder.is_dir():
        # Checked before importing torchvision (slow import) and before any I/O.
        raise FileNotFoundError(
            f"{name} not found: no folder {folder}. Put torchvision's extracted "
            f"'{folder.name}' folder (from {CIFAR_ARCHIVES[name]}) under data_dir "
            f"(or ${DATA_DIR_ENV}), or allow the download with the data spec's "
            f"download: true (dataset.download)."
        )
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    try:
        ds = cls(root=str(root), train=(split == "train"), download=download)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise FileNotFoundError(
            f"{name}: files under {root / cls.base_folder} are missing or corrupted "
            f"({exc}). Re-extract {cls.filename} there, or allow the download with "
            f"the data spec's download: true."
        ) from exc
    images = np.ascontiguousarray(ds.data, dtype=np.uint8)  # (N, 32, 32, 3) NHWC
    labels = np.asarray(ds.targets, dtype=np.int64)
    return images, labels
