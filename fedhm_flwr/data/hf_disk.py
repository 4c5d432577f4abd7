"""A Hugging Face ``datasets`` folder written by ``save_to_disk`` (``dataset=hf_disk dataset.path=DIR``).

``DIR`` holds a ``DatasetDict`` (its ``dataset.train_split`` is trained on; the test split is
``dataset.test_split``, or else the first of test / val / validation present) or a single
``Dataset``. Without a test split, a stratified ``dataset.test_fraction`` of each class, drawn with
a fixed seed, is the test set. Images come from ``dataset.image_column`` (an ``Image`` feature, or
arrays ``H x W [x C]`` / ``C x H x W``, uint8 or floats in [0, 1]), converted to
``dataset.channels`` and scaled and centre-cropped to ``dataset.image_size``
(:func:`fedhm_flwr.data.imagefolder.fit_image`). Labels come from ``dataset.label_column``: a
``ClassLabel`` (its names give the classes), integers ``0..C-1``, or strings (the classes are their
sorted distinct values over both splits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedhm_flwr.core.errors import DataSourceError
from fedhm_flwr.data.imagefolder import fit_image
from fedhm_flwr.data.layouts import hf_disk_layout
from fedhm_flwr.data.partitioning import fraction_split


def _splits(spec: dict[str, Any], data_dir: Any) -> dict[str, Any]:
    """The saved splits used: {"train": Dataset, "test": Dataset or None}."""
    import datasets

    datasets.disable_progress_bars()
    layout = hf_disk_layout(spec, data_dir)
    saved = datasets.load_from_disk(str(layout["root"]))
    if layout["train"] is None:
        return {"train": saved, "test": None}
    return {"train": saved[layout["train"]], "test": saved[layout["test"]] if layout["test"] else None}


def _raw_labels(spec: dict[str, Any], parts: dict[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """Each used split's labels as class ids, and the number of classes."""
    import datasets

    column = spec["label_column"]
    feature = parts["train"].features[column]
    raw = {k: np.asarray(d.with_format("numpy", columns=[column])[column]) for k, d in parts.items() if d is not None}
    if isinstance(feature, datasets.ClassLabel):
        return {k: v.astype(np.int64) for k, v in raw.items()}, int(feature.num_classes)
    values = np.concatenate(list(raw.values()))
    if values.dtype.kind in "iu":
        if len(values) and values.min() < 0:
            raise DataSourceError(
                "dataset.label_column",
                column,
                f"negative labels ({int(values.min())})",
                "a ClassLabel column, integers 0..C-1 or strings",
            )
        return {k: v.astype(np.int64) for k, v in raw.items()}, int(values.max()) + 1 if len(values) else 0
    if values.dtype.kind in "UO":
        names = sorted({str(v) for v in values})
        index = {n: i for i, n in enumerate(names)}
        return {k: np.array([index[str(x)] for x in v], dtype=np.int64) for k, v in raw.items()}, len(names)
    raise DataSourceError(
        "dataset.label_column",
        column,
        f"its values are of type {values.dtype}",
        "a ClassLabel column, integers 0..C-1 or strings",
    )


def num_classes(spec: dict[str, Any], data_dir: Any = None) -> int:
    """The number of classes (from a ``ClassLabel`` feature without reading the column)."""
    return _raw_labels(spec, _splits(spec, data_dir))[1]


def _images(ds: Any, spec: dict[str, Any]) -> np.ndarray:
    size, channels = spec["image_size"], spec["channels"]
    out = np.zeros((len(ds), size, size, channels), dtype=np.uint8)
    for i, image in enumerate(ds.select_columns([spec["image_column"]])):
        out[i] = fit_image(image[spec["image_column"]], size, channels)
    return out


def load_splits(spec: dict[str, Any], data_dir: Any = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images uint8 NHWC, labels int64), "test": ...}`` of a validated data spec."""
    parts = _splits(spec, data_dir)
    labels, _ = _raw_labels(spec, parts)
    train = (_images(parts["train"], spec), labels["train"])
    if parts["test"] is not None:
        return {"train": train, "test": (_images(parts["test"], spec), labels["test"])}
    tr, te = fraction_split(train[1], spec["test_fraction"])
    return {"train": (train[0][tr], train[1][tr]), "test": (train[0][te], train[1][te])}
