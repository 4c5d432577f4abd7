"""The dataset registry (shapes, classes, normalisation), the per-process caches,
:func:`load_arrays`, which reads a whole split of a built-in dataset (``idx``, ``cifar``), and
:func:`source_arrays` / :func:`source_info`, which do the same from a data spec, for the built-in
datasets and the folder sources (``imagefolder``, ``hf_disk``) alike."""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.data.files import DATA_DIR_ENV, FOLDER_SOURCES

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
            f"dataset.name: unknown dataset {name!r}; allowed values: "
            f"{sorted(DATASETS) + sorted(EXTERNAL_DATASETS) + list(FOLDER_SOURCES)}"
        )
    return DATASETS[name]


def _folder_module(name: str) -> Any:
    """The loader module of folder source ``name`` (``fedhm_flwr.data.imagefolder`` / ``.hf_disk``)."""
    return importlib.import_module(f"fedhm_flwr.data.{name}")


def dataset_info(name: str, spec: dict[str, Any] | None = None) -> dict[str, int]:
    """Return ``{"num_classes", "in_channels", "image_size"}`` of dataset ``name``.

    Exactly these three keys, so that it can be splatted into a model builder. A folder source
    (``imagefolder``, ``hf_disk``) needs its data ``spec``: the classes are read from
    ``dataset.path``, the shape is ``dataset.channels`` x ``dataset.image_size``.
    Raises ValueError naming ``dataset.name`` for an unknown dataset.
    """
    if name in FOLDER_SOURCES:
        if spec is None:
            raise ValueError(f"dataset.name={name!r}: its classes depend on dataset.path; pass the data spec")
        from fedhm_flwr.data.spec import check_data_spec

        spec = check_data_spec(spec)
        return {"num_classes": _folder_module(name).num_classes(spec), "in_channels": spec["channels"],
                "image_size": spec["image_size"]}
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
_INFO_CACHE: dict[tuple[Any, ...], DatasetInfo] = {}  # folder sources: facts measured on the data


def clear_caches() -> None:
    """Forget every array and partition cached in this process (tests, memory)."""
    with _LOCK:
        _ARRAY_CACHE.clear()
        _PARTITION_CACHE.clear()
        _INFO_CACHE.clear()


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


# --------------------------------------------------------------------------- from a data spec


def _source_key(spec: dict[str, Any], data_dir: str | os.PathLike[str] | None) -> tuple[Any, ...]:
    """Cache key of a folder source: its folder and every option that changes the arrays."""
    from fedhm_flwr.data.spec import SOURCE_DEFAULTS

    root = data_dir or spec["path"]
    options = tuple((k, spec[k]) for k in sorted(SOURCE_DEFAULTS[spec["name"]]) if k != "path")
    return (spec["name"], str(Path(str(root)).expanduser().resolve())) + options


def source_arrays(
    spec: dict[str, Any], split: str, data_dir: str | os.PathLike[str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A whole split ("train" | "test") of a validated data spec's dataset, as :func:`load_arrays` gives it.

    Folder sources read ``data_dir`` (a node's full copy) when given, else ``dataset.path``; both of
    their splits are decoded at once and cached per process.
    """
    name = spec["name"]
    if name not in FOLDER_SOURCES:
        return load_arrays(name, split, data_dir, spec["download"])
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed values: {list(SPLITS)}")
    key = _source_key(spec, data_dir)
    with _LOCK:
        if (key, split) not in _ARRAY_CACHE:
            for part, (images, labels) in _folder_module(name).load_splits(spec, data_dir).items():
                _ARRAY_CACHE[(key, part)] = (_readonly(images), _readonly(labels))  # type: ignore[index]
        return _ARRAY_CACHE[(key, split)]  # type: ignore[index]


def source_info(spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None) -> DatasetInfo:
    """The :class:`DatasetInfo` of a validated data spec's dataset.

    A folder source's mean and std are measured per channel on its training split (as the built-in
    datasets' are), its shape is ``dataset.channels`` x ``dataset.image_size``.
    """
    name = spec["name"]
    if name not in FOLDER_SOURCES:
        return _info(name)
    key = _source_key(spec, data_dir)
    with _LOCK:
        if key not in _INFO_CACHE:
            images, labels = source_arrays(spec, "train", data_dir)
            channels = [images[..., c].astype(np.float32) / 255.0 for c in range(images.shape[-1])]
            _INFO_CACHE[key] = DatasetInfo(
                name, _folder_module(name).num_classes(spec, data_dir), spec["channels"], spec["image_size"],
                tuple(float(x.mean(dtype=np.float64)) for x in channels),
                tuple(max(float(x.std(dtype=np.float64)), 1e-3) for x in channels),
                len(labels), len(source_arrays(spec, "test", data_dir)[1]),
            )
        return _INFO_CACHE[key]


#: class names of the built-in datasets, in label order (the folder sources name theirs)
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fashion_mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}


def class_names(spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None) -> list[str] | None:
    """The names of a validated data spec's classes in label order (a folder source's sorted
    class folders / ClassLabel names), or None where the project does not know them."""
    name = spec["name"]
    if name in FOLDER_SOURCES:
        from fedhm_flwr.data.files import folder_source_layout

        layout = folder_source_layout(name, spec, data_dir)
        if "classes" in layout:
            return [str(c) for c in layout["classes"]]
        names = getattr(layout["features"].get(spec["label_column"]), "names", None)  # hf_disk: a ClassLabel's
        return [str(c) for c in names] if names else None
    return list(CLASS_NAMES[name]) if name in CLASS_NAMES else None
