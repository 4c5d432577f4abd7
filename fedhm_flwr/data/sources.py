"""What a data source reads, whichever it is: :func:`dataset_info`, :func:`load_arrays`, which reads a
whole split of a built-in dataset (``idx``, ``cifar``), and :func:`source_arrays` /
:func:`source_info` / :func:`class_names`, which do the same from a data spec, for the built-in
datasets and the folder sources (``imagefolder``, ``hf_disk``) alike; the nodes' partitions of a
spec (:func:`partition_indices`) and the launcher's check that they can be made
(:func:`check_partitions`). The facts themselves are in
:mod:`fedhm_flwr.data.catalog`, the caches in :mod:`fedhm_flwr.data.cache`."""

from __future__ import annotations

import csv
import io
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.data import hf_disk, imagefolder
from fedhm_flwr.data.cache import ARRAY_CACHE, INFO_CACHE, LOCK, WORK, readonly
from fedhm_flwr.data.catalog import (
    CLASS_NAMES,
    DATASETS,
    EXTERNAL_DATASETS,
    FOLDER_SOURCES,
    SPLITS,
    DatasetInfo,
    image_info,
    text_dataset_info,
    text_info,
)
from fedhm_flwr.data.cifar import load_cifar
from fedhm_flwr.data.files import DATA_DIR_ENV, corpus_path
from fedhm_flwr.data.idx import load_fashion_mnist, load_fashion_mnist_labels
from fedhm_flwr.data.layouts import folder_source_layout
from fedhm_flwr.data.partitioning import most_partitions, partition_problem, subset_partition
from fedhm_flwr.data.spec import SOURCE_DEFAULTS, check_data_spec

__all__ = [
    "CLASS_NAMES",
    "DATASETS",
    "EXTERNAL_DATASETS",
    "SPLITS",
    "DatasetInfo",
    "check_partitions",
    "class_names",
    "dataset_info",
    "load_arrays",
    "load_corpus",
    "partition_indices",
    "source_arrays",
    "source_info",
    "source_labels",
    "split_indices",
    "split_labels",
]

#: folder source name -> its loader module (``num_classes``, ``load_splits``)
FOLDER_LOADERS: dict[str, Any] = {"imagefolder": imagefolder, "hf_disk": hf_disk}
assert set(FOLDER_LOADERS) == set(FOLDER_SOURCES)


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
        spec = check_data_spec(spec)
        return {
            "num_classes": FOLDER_LOADERS[name].num_classes(spec),
            "in_channels": spec["channels"],
            "image_size": spec["image_size"],
        }
    if name in EXTERNAL_DATASETS:
        return text_dataset_info(name)
    info = image_info(name)
    return {
        "num_classes": info.num_classes,
        "in_channels": info.in_channels,
        "image_size": info.image_size,
    }


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
    info = image_info(name)
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed values: {list(SPLITS)}")
    key = (name, split, _resolved_key(data_dir))
    with LOCK:
        hit = ARRAY_CACHE.get(key)
        if hit is not None:
            return hit
        d = None if data_dir is None else str(data_dir)
        if name == "fashion_mnist":
            images, labels = load_fashion_mnist(split, d)
        else:
            images, labels = load_cifar(name, split, d, download)
        if images.shape[1:] != (info.image_size, info.image_size, info.in_channels):
            raise ValueError(f"{name}/{split}: unexpected image shape {images.shape}")
        out = (readonly(images), readonly(labels))
        ARRAY_CACHE[key] = out
        WORK["decode"] += 1
        return out


# --------------------------------------------------------------------------- from a data spec


def _source_key(spec: dict[str, Any], data_dir: str | os.PathLike[str] | None) -> tuple[Any, ...]:
    """Cache key of a folder source: its folder and every option that changes the arrays."""
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
    with LOCK:
        if (key, split) not in ARRAY_CACHE:
            for part, (images, labels) in FOLDER_LOADERS[name].load_splits(spec, data_dir).items():
                ARRAY_CACHE[(key, part)] = (readonly(images), readonly(labels))
                WORK["decode"] += 1
        return ARRAY_CACHE[(key, split)]


def source_labels(spec: dict[str, Any], split: str, data_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """The labels of a whole split, as :func:`source_arrays` gives them; Fashion-MNIST's without decoding
    its images when this process has not loaded them (the launcher's check: the nodes decode them)."""
    if spec["name"] == "fashion_mnist" and split in SPLITS:
        with LOCK:
            hit = ARRAY_CACHE.get(("fashion_mnist", split, _resolved_key(data_dir)))
        if hit is None:
            return readonly(load_fashion_mnist_labels(split, None if data_dir is None else str(data_dir)))
    return source_arrays(spec, split, data_dir)[1]


def source_info(spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None) -> DatasetInfo:
    """The :class:`DatasetInfo` of a validated data spec's dataset.

    A folder source's mean and std are measured per channel on its training split (as the built-in
    datasets' are), its shape is ``dataset.channels`` x ``dataset.image_size``.
    """
    name = spec["name"]
    if name not in FOLDER_SOURCES:
        return image_info(name)
    key = _source_key(spec, data_dir)
    with LOCK:
        if key not in INFO_CACHE:
            images, labels = source_arrays(spec, "train", data_dir)
            channels = [images[..., c].astype(np.float32) / 255.0 for c in range(images.shape[-1])]
            INFO_CACHE[key] = DatasetInfo(
                name,
                FOLDER_LOADERS[name].num_classes(spec, data_dir),
                spec["channels"],
                spec["image_size"],
                tuple(float(x.mean(dtype=np.float64)) for x in channels),
                tuple(max(float(x.std(dtype=np.float64)), 1e-3) for x in channels),
                len(labels),
                len(source_arrays(spec, "test", data_dir)[1]),
            )
        return INFO_CACHE[key]


def class_names(spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None) -> list[str] | None:
    """The names of a validated data spec's classes in label order (a folder source's sorted
    class folders / ClassLabel names), or None where the project does not know them."""
    name = spec["name"]
    if name in FOLDER_SOURCES:
        layout = folder_source_layout(name, spec, data_dir)
        if "classes" in layout:
            return [str(c) for c in layout["classes"]]
        names = getattr(layout["features"].get(spec["label_column"]), "names", None)  # hf_disk: a ClassLabel's
        return [str(c) for c in names] if names else None
    return list(CLASS_NAMES[name]) if name in CLASS_NAMES else None


# --------------------------------------------------------------------------- the text corpora (torch-free)

SPLIT_SEED = 20240607  # the text datasets' fixed train / test split
_CORPUS_LOCK = threading.RLock()
_CORPUS: dict[str, tuple[list[str], np.ndarray]] = {}
_SPLITS: dict[str, dict[str, np.ndarray]] = {}


def load_corpus(name: str) -> tuple[list[str], np.ndarray]:
    """(texts, int64 labels) of the dataset's classes, deduplicated; cached per process."""
    info = text_info(name)
    with _CORPUS_LOCK:
        if name in _CORPUS:
            return _CORPUS[name]
        raw = corpus_path(name).read_bytes()
        # The file mixes encodings (a few stray cp1252 bytes); undecodable bytes become U+FFFD.
        reader = csv.DictReader(io.StringIO(raw.decode("utf-8", errors="replace"), newline=""))
        index = {c: i for i, c in enumerate(info.classes)}
        seen: dict[str, int] = {}
        order: list[str] = []
        for row in reader:
            label, text = (row.get("sentiment") or "").strip(), " ".join((row.get("text") or "").split())
            if label not in index or not text:
                continue
            if text in seen:
                if seen[text] != index[label]:
                    seen[text] = -1  # contradictory copies: drop the text
                continue
            seen[text] = index[label]
            order.append(text)
        texts = [t for t in order if seen[t] >= 0]
        labels = np.array([seen[t] for t in texts], dtype=np.int64)
        labels.setflags(write=False)
        _CORPUS[name] = (texts, labels)
        return _CORPUS[name]


def _splits(name: str) -> dict[str, np.ndarray]:
    """Stratified fixed-seed train / test indices into the corpus."""
    info = text_info(name)
    with _CORPUS_LOCK:
        if name not in _SPLITS:
            labels = load_corpus(name)[1]
            rng = np.random.default_rng(SPLIT_SEED)
            test = []
            for c in range(info.num_classes):
                idx = rng.permutation(np.flatnonzero(labels == c))
                test.append(idx[: int(round(info.test_fraction * len(idx)))])
            is_test = np.zeros(len(labels), dtype=bool)
            is_test[np.concatenate(test)] = True
            _SPLITS[name] = {"train": np.flatnonzero(~is_test), "test": np.flatnonzero(is_test)}
        return _SPLITS[name]


def split_indices(name: str, split: str) -> np.ndarray:
    """Corpus rows of a split ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split: unknown split {split!r}; allowed values: ['train', 'test']")
    return _splits(name)[split]


def split_labels(name: str, split: str) -> np.ndarray:
    """Labels of a whole split (no tokenization)."""
    return load_corpus(name)[1][split_indices(name, split)]


# --------------------------------------------------------------------------- the nodes' partitions


def partition_indices(data_spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None) -> list[np.ndarray]:
    """Indices into the *full* training arrays, one sorted array per partition, as every node
    computes them (:func:`~fedhm_flwr.data.partitioning.subset_partition`: ``max_train_examples``'
    seeded subset first, then the partitioner)."""
    spec = check_data_spec(data_spec)
    return subset_partition(source_arrays(spec, "train", data_dir)[1], spec)


def check_partitions(data_spec: dict[str, Any]) -> None:
    """Refuse, before a simulation starts, data its nodes cannot learn from: a dataset of fewer than
    2 classes, and partitions that cannot be made from the examples and nodes given, computed as the
    simulated nodes compute them (:func:`partition_indices`, on the data they read). One
    :class:`~fedhm_flwr.core.errors.ConfigError` naming the fields and what would be allowed. A text
    dataset's classes are those its training split holds (:func:`split_labels`, no tokenizer)."""
    spec = check_data_spec(data_spec)
    name = spec["name"]
    text = name in EXTERNAL_DATASETS
    labels = split_labels(name, "train") if text else None
    classes = len(np.unique(labels)) if labels is not None else dataset_info(name, spec)["num_classes"]
    if classes < 2:
        field, value, what = (
            ("dataset.name", name, "labels in its training split")
            if text
            else ("dataset.label_column", spec["label_column"], "distinct labels")
            if name == "hf_disk"
            else ("dataset.path", spec["path"], "class sub-folders")
        )
        held = [text_info(name).classes[c] for c in np.unique(labels)] if labels is not None else class_names(spec)
        raise ConfigError(field, value, f"data of at least 2 classes ({what}): it holds {classes} {held or ''}".strip())
    labels = source_labels(spec, "train", None) if labels is None else labels
    problem = partition_problem(labels, spec)
    if problem is None:
        return
    count = spec["num_partitions"]
    examples = len(labels) if not 0 < spec["max_train_examples"] < len(labels) else spec["max_train_examples"]
    works = most_partitions(labels, spec)
    scheme = f"partition.scheme={spec['scheme']}" + (
        f" (partition.alpha={spec['alpha']:g})" if spec["scheme"] == "dirichlet" else ""
    )
    more = "more training examples (dataset.max_train_examples" + (", 0: all)" if spec["max_train_examples"] else ")")
    if spec["scheme"] == "dirichlet":
        more += " or a larger partition.alpha"
    fewer = f"num_clients={works} can (computed as the nodes do)" if works else "no number of nodes can"
    raise ConfigError(
        "num_clients",
        count,
        f"a number of nodes that {scheme} can each give a partition of the {examples} training examples: "
        f"{count} cannot ({problem}); {fewer}; or {more}",
    )
