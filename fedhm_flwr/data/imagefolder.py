"""Your own images in torchvision's ``ImageFolder`` layout (``dataset=imagefolder dataset.path=DIR``).

``DIR`` holds one sub-folder per class (``DIR/cat/1.png``, ``DIR/dog/7.jpg``, ...), or
``DIR/train/`` does, with the test images in ``DIR/test/`` or ``DIR/val/`` laid out the same way
(:func:`fedhm_flwr.data.layouts.imagefolder_layout`). Classes are the training split's sub-folders in
sorted order (torchvision's ``find_classes``), so class ``i`` is the ``i``-th folder name, also in
the test split. The files are listed by torchvision's ``make_dataset``, opened with PIL, converted
to ``dataset.channels`` (L or RGB), and scaled and centre-cropped to ``dataset.image_size`` square
(``PIL.ImageOps.fit``). Without a test folder, a stratified ``dataset.test_fraction`` of each
class, drawn with a fixed seed, is the test set (:func:`fedhm_flwr.data.partitioning.fraction_split`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.data.layouts import IMAGE_EXTENSIONS, imagefolder_layout
from fedhm_flwr.data.partitioning import fraction_split


def fit_image(image: Any, size: int, channels: int) -> np.ndarray:
    """A PIL image (or an ``H x W [x C]`` array) as ``uint8 (size, size, channels)``: converted to L or
    RGB, scaled so that it covers the square, and centre-cropped."""
    from PIL import Image, ImageOps

    if not isinstance(image, Image.Image):
        array = np.asarray(image)
        if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
            array = array.transpose(1, 2, 0)  # CHW -> HWC
        if array.ndim == 3 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.dtype != np.uint8:
            scale = 255.0 if array.size and float(array.max()) <= 1.0 else 1.0
            array = np.clip(np.rint(array.astype(np.float64) * scale), 0, 255).astype(np.uint8)
        image = Image.fromarray(array)
    image = image.convert("L" if channels == 1 else "RGB")
    if image.size != (size, size):
        image = ImageOps.fit(image, (size, size), method=Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).reshape(size, size, channels)


def num_classes(spec: dict[str, Any], data_dir: Any = None) -> int:
    """The number of class folders."""
    return len(imagefolder_layout(spec, data_dir)["classes"])


def _read(folder: Path, class_to_idx: dict[str, int], spec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    from torchvision.datasets.folder import make_dataset

    samples = make_dataset(str(folder), class_to_idx, IMAGE_EXTENSIONS, allow_empty=True)
    size, channels = spec["image_size"], spec["channels"]
    images = np.zeros((len(samples), size, size, channels), dtype=np.uint8)
    from PIL import Image, UnidentifiedImageError

    for i, (path, _) in enumerate(samples):
        try:
            with Image.open(path) as image:
                images[i] = fit_image(image, size, channels)
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"dataset.path: {path} is not a readable image ({exc})") from None
    return images, np.array([label for _, label in samples], dtype=np.int64)


def load_splits(spec: dict[str, Any], data_dir: Any = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images uint8 NHWC, labels int64), "test": ...}`` of a validated data spec."""
    layout = imagefolder_layout(spec, data_dir)
    class_to_idx = {c: i for i, c in enumerate(layout["classes"])}
    images, labels = _read(layout["train"], class_to_idx, spec)
    if layout["test"] is not None:
        return {"train": (images, labels), "test": _read(layout["test"], class_to_idx, spec)}
    train, test = fraction_split(labels, spec["test_fraction"])
    return {"train": (images[train], labels[train]), "test": (images[test], labels[test])}
