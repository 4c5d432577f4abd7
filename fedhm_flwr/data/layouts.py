"""The layout of your own data (:data:`~fedhm_flwr.data.catalog.FOLDER_SOURCES`), checked before any
image is decoded.

``dataset.path`` (a node's ``data-dir``, when it gives one with its ``partition-id``, takes its
place) is either a folder in torchvision's ``ImageFolder`` layout (``imagefolder``,
:func:`imagefolder_layout`) or a Hugging Face ``datasets`` folder written by ``save_to_disk``
(``hf_disk``, :func:`hf_disk_layout`). Both are checked here by listing folders and reading
``datasets``' small JSON files; :func:`check_images_decodable` then decodes an image folder's
images once, before any process starts. Light on purpose (no numpy, no torch), as
:mod:`fedhm_flwr.data.files`, whose pre-start check uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fedhm_flwr.core.errors import DataSourceError
from fedhm_flwr.core.protocol import DATA_DIR
from fedhm_flwr.data.cache import disk_cache

#: the file endings an image folder's images may have (torchvision's ``IMG_EXTENSIONS``)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: the test split's names tried, in order, when ``dataset.test_split`` is null
TEST_SPLIT_NAMES = ("test", "val", "validation")
IMAGEFOLDER_LAYOUT = (
    "a folder in torchvision's ImageFolder layout: one sub-folder per class holding its images "
    f"({', '.join(IMAGE_EXTENSIONS[:3])}, ...), either in dataset.path itself or in "
    "dataset.path/<dataset.train_split> with a test/ or val/ folder beside it"
)
HF_DISK_LAYOUT = (
    "a folder written by datasets' save_to_disk: a Dataset, or a DatasetDict holding the dataset.train_split split"
)
_TEST_SPLIT_ALLOWED = (
    f"null (the first of {list(TEST_SPLIT_NAMES)} present, else a seeded dataset.test_fraction "
    "of each class) or the name of the test split"
)


def source_root(spec: dict[str, Any], data_dir: Any, expected: str) -> tuple[str, Path]:
    """(config field, folder) of a folder source: a node's ``data-dir`` when given, else ``dataset.path``."""
    if data_dir:
        return DATA_DIR, Path(data_dir).expanduser()
    path = spec.get("path")
    if not path:
        raise DataSourceError("dataset.path", path, "not set", expected)
    return "dataset.path", Path(str(path)).expanduser()


def class_folders(folder: Path) -> list[str]:
    """The class names of an ImageFolder split: its sub-folders, sorted (torchvision's ``find_classes``)."""
    return sorted(e.name for e in os.scandir(folder) if e.is_dir())


def holds_images(folder: Path) -> bool:
    """Whether ``folder`` (walked as torchvision's ``make_dataset`` walks it) holds at least one image."""
    for _, _, names in os.walk(folder, followlinks=True):
        if any(n.lower().endswith(IMAGE_EXTENSIONS) for n in names):
            return True
    return False


def imagefolder_layout(spec: dict[str, Any], data_dir: Any = None) -> dict[str, Any]:
    """``{"train": folder, "test": folder or None, "classes": [...]}`` of an image folder source.

    ``dataset.path`` holds the class folders, or ``<train_split>/`` does (then the test split is
    ``dataset.test_split``, or else the first of :data:`TEST_SPLIT_NAMES` beside it). Raises
    :class:`DataSourceError` for a missing folder, no class folders, a class without images, or
    test classes the training split lacks.
    """
    field, root = source_root(spec, data_dir, IMAGEFOLDER_LAYOUT)
    if not root.is_dir():
        raise DataSourceError(field, str(root), "no such folder", IMAGEFOLDER_LAYOUT)
    train_split, test_split = str(spec.get("train_split") or "train"), spec.get("test_split")
    train: Path = root / train_split
    test: Path | None = None
    if train.is_dir() and class_folders(train):
        names = [str(test_split)] if test_split else list(TEST_SPLIT_NAMES)
        test = next((root / n for n in names if (root / n).is_dir()), None)
    else:
        train = root
    if test_split and test is None:
        raise DataSourceError(
            "dataset.test_split",
            test_split,
            f"no folder {root / str(test_split)} beside the training folder {root / train_split}",
            _TEST_SPLIT_ALLOWED,
        )
    classes = class_folders(train)
    if not classes:
        raise DataSourceError(field, str(root), f"no class folders in {train}", IMAGEFOLDER_LAYOUT)
    empty = [c for c in classes if not holds_images(train / c)]
    if empty:
        raise DataSourceError(
            field, str(root), f"class folder(s) {empty[:5]} in {train} hold no image", IMAGEFOLDER_LAYOUT
        )
    if test is not None:
        extra = sorted(set(class_folders(test)) - set(classes))
        if extra:
            raise DataSourceError(
                field,
                str(root),
                f"the test folder {test} has class folder(s) {extra[:5]} that {train} lacks",
                "the test classes among the training classes",
            )
    return {"train": train, "test": test, "classes": classes}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def hf_disk_layout(spec: dict[str, Any], data_dir: Any = None) -> dict[str, Any]:
    """``{"root", "train": split name or None (a plain Dataset), "test": split name or None, "features":
    {split: {column: feature}}}`` of a ``save_to_disk`` folder, from its JSON files alone.

    Raises :class:`DataSourceError` for a missing or foreign folder, a missing split, or a missing
    ``dataset.image_column`` / ``dataset.label_column``.
    """
    field, root = source_root(spec, data_dir, HF_DISK_LAYOUT)
    if not root.is_dir():
        raise DataSourceError(field, str(root), "no such folder", HF_DISK_LAYOUT)
    train_split, test_split = str(spec.get("train_split") or "train"), spec.get("test_split")
    splits = _read_json(root / "dataset_dict.json")
    if isinstance(splits, dict) and isinstance(splits.get("splits"), list):
        names = [str(s) for s in splits["splits"]]
        if train_split not in names:
            raise DataSourceError(
                "dataset.train_split",
                train_split,
                f"not among the splits {names} of {root}",
                "the name of the training split",
            )
        if test_split and test_split not in names:
            raise DataSourceError(
                "dataset.test_split", test_split, f"not among the splits {names} of {root}", _TEST_SPLIT_ALLOWED
            )
        test = test_split or next((n for n in TEST_SPLIT_NAMES if n in names), None)
        used = {train_split: root / train_split, **({test: root / test} if test else {})}
        train: str | None = train_split
    elif (root / "dataset_info.json").is_file() and (root / "state.json").is_file():
        if test_split:
            raise DataSourceError(
                "dataset.test_split",
                test_split,
                f"{root} holds one Dataset, not a DatasetDict",
                "null (a seeded dataset.test_fraction of each class is the test set)",
            )
        train, test, used = None, None, {"": root}
    else:
        raise DataSourceError(
            field,
            str(root),
            "not a save_to_disk folder (no dataset_dict.json, nor dataset_info.json and state.json)",
            HF_DISK_LAYOUT,
        )
    features: dict[str, dict[str, Any]] = {}
    for name, folder in used.items():
        info = _read_json(folder / "dataset_info.json")
        feats = info.get("features") if isinstance(info, dict) else None
        if not isinstance(feats, dict):
            raise DataSourceError(
                field, str(root), f"{folder / 'dataset_info.json'} is missing or lists no features", HF_DISK_LAYOUT
            )
        for key, default, what in (("image_column", "image", "images"), ("label_column", "label", "labels")):
            column = str(spec.get(key) or default)
            if column not in feats:
                where = f"split {name!r}" if name else "the dataset"
                raise DataSourceError(
                    f"dataset.{key}",
                    column,
                    f"no such column in {where} of {root} (its columns: {list(feats)})",
                    f"the name of the column holding the {what}",
                )
        features[name] = feats
    return {"root": root, "train": train, "test": test, "features": features}


def image_files(layout: dict[str, Any]) -> list[Path]:
    """Every image file of an image folder source's splits (class folders walked as torchvision's
    ``make_dataset`` walks them: recursively, links followed, by extension), sorted."""
    files: list[Path] = []
    for split in (layout["train"], layout["test"]):
        if split is None:
            continue
        for cls in layout["classes"]:
            for folder, _, names in os.walk(split / cls, followlinks=True):
                files += [Path(folder) / n for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(files)


def check_images_decodable(layout: dict[str, Any], field: str = "dataset.path") -> None:
    """Decode every image of an image folder source once, before any process starts: a file PIL
    cannot read raises :class:`DataSourceError` naming it. A listing found good (paths, sizes and
    modification times) is remembered in ``$FEDHM_CACHE/checked-images`` (default
    ``~/.cache/fedhm-flwr``), so the check costs a directory walk after the first time."""
    from PIL import Image, UnidentifiedImageError  # Pillow, imported where images are decoded

    files = image_files(layout)
    listing = hashlib.sha256()
    for path in files:
        st = path.stat()
        listing.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    cache = disk_cache("checked-images")
    marker = cache / listing.hexdigest()
    if marker.is_file():
        return
    for path in files:
        try:
            with Image.open(path) as image:
                image.load()
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
            raise DataSourceError(
                field,
                str(path),
                f"{path} is not a readable image ({exc})",
                "every image file decodable (fix or remove it)",
            ) from None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{len(files)} images\n")
    except OSError:  # a read-only home: the check runs again next time
        pass


def folder_source_layout(name: str, spec: dict[str, Any], data_dir: Any = None) -> dict[str, Any]:
    """The layout of folder source ``name`` (:data:`FOLDER_SOURCES`); DataSourceError when broken."""
    return imagefolder_layout(spec, data_dir) if name == "imagefolder" else hf_disk_layout(spec, data_dir)
