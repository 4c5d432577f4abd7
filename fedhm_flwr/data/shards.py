"""Per-node data shards: export every partition of a run as a self-contained folder; load one.

A node of a real deployment holds only its own examples. ::

    python -m fedhm_flwr.ops.deploy.shard_export <the run's Hydra overrides> out=DIR     (or --out DIR)

writes ``DIR/partition-<i>/`` for every partition ``i`` of the run (``num_clients`` partitions
of the configured dataset, partitioner, seed, ``dataset.max_train_examples`` and held-out
fraction): exactly the examples, in the same order, that the simulation's
:func:`fedhm_flwr.data.client_dataset` gives partition ``i`` for the "train" and "heldout" splits.

Format (``docs/DEPLOY.md``, "Shard format"; a user can write one from their own data):

* a Hugging Face ``datasets.DatasetDict({"train": ..., "heldout": ...})`` saved with
  ``save_to_disk``; columns ``image`` (``datasets.Array3D(shape=(H, W, C), dtype="uint8")``,
  raw pixels) and ``label`` (``int64``);
* ``manifest.json``: see :func:`make_manifest`; each split's ``sha256`` is taken over its image
  bytes (uint8, NHWC, C order) followed by its label bytes (int64 little-endian).

:func:`load_shard` gives the same :class:`~fedhm_flwr.data.ImageTensorDataset` as
``client_dataset``, normalised with the manifest's mean/std, after checking the checksum.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.core.errors import ShardError as ShardError  # re-exported for the client
from fedhm_flwr.data.catalog import DATASETS, EXTERNAL_DATASETS, FOLDER_SOURCES, DatasetInfo
from fedhm_flwr.data.clients import client_arrays
from fedhm_flwr.data.sources import source_info
from fedhm_flwr.data.spec import CLIENT_SPLITS, check_data_spec
from fedhm_flwr.data.tensors import ImageTensorDataset, image_dataset

MANIFEST = "manifest.json"
FORMAT = "fedhm-shard"
FORMAT_VERSION = 1
SPLITS = CLIENT_SPLITS
#: manifest keys a node needs to load a shard (the others describe where it came from)
REQUIRED_KEYS = (
    "format",
    "format_version",
    "dataset",
    "num_classes",
    "in_channels",
    "image_size",
    "mean",
    "std",
    "splits",
)

_LOCK = threading.Lock()
_VERIFIED: dict[tuple[str, str], tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]]] = {}


def partition_dir(out: str | Path, partition_id: int) -> Path:
    """Where :func:`export_shards` writes partition ``partition_id``."""
    return Path(out) / f"partition-{partition_id}"


def checksum(images: np.ndarray, labels: np.ndarray) -> str:
    """sha256 over the image bytes (uint8 NHWC, C order) then the label bytes (int64 little-endian)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(images, dtype=np.uint8).tobytes())
    h.update(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return h.hexdigest()


def partitioner_params(spec: dict[str, Any]) -> dict[str, Any]:
    """The partition scheme and the parameters it uses (as ``data.partition`` reads them)."""
    params: dict[str, Any] = {"scheme": spec["scheme"]}
    if spec["scheme"] == "dirichlet":
        params.update(alpha=spec["alpha"], min_partition_size=spec["min_partition_size"])
    elif spec["scheme"] == "pathological":
        params.update(classes_per_partition=spec["classes_per_partition"], class_assignment=spec["class_assignment"])
    return params


def make_manifest(
    spec: dict[str, Any],
    partition_id: int,
    splits: dict[str, tuple[np.ndarray, np.ndarray]],
    info: DatasetInfo | None = None,
) -> dict[str, Any]:
    """The manifest of partition ``partition_id`` of a validated data spec, given its split arrays
    (``info``: the dataset's facts, :func:`fedhm_flwr.data.sources.source_info`; looked up when None)."""
    info = info if info is not None else source_info(spec)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dataset": info.name,
        "num_classes": info.num_classes,
        "in_channels": info.in_channels,
        "image_size": info.image_size,
        "mean": list(info.mean),
        "std": list(info.std),
        "partitioner": partitioner_params(spec),
        "seed": spec["seed"],
        "max_train_examples": spec["max_train_examples"],
        "partition_id": partition_id,
        "num_partitions": spec["num_partitions"],
        "holdout": spec["holdout"],
        "splits": {
            name: {
                "num_examples": int(len(labels)),
                "class_counts": np.bincount(labels, minlength=info.num_classes).astype(int).tolist(),
                "sha256": checksum(images, labels),
            }
            for name, (images, labels) in splits.items()
        },
    }


def write_shard(folder: str | Path, splits: dict[str, tuple[np.ndarray, np.ndarray]], manifest: dict[str, Any]) -> Path:
    """Save the split arrays as a ``DatasetDict`` under ``folder`` and the manifest beside them."""
    import datasets

    datasets.disable_progress_bars()
    folder = Path(folder)
    parts = {}
    for name, (images, labels) in splits.items():
        features = datasets.Features(
            {
                "image": datasets.Array3D(shape=tuple(images.shape[1:]), dtype="uint8"),
                "label": datasets.Value("int64"),
            }
        )
        parts[name] = datasets.Dataset.from_dict(
            {"image": np.ascontiguousarray(images, dtype=np.uint8), "label": np.asarray(labels, np.int64)},
            features=features,
        )
    # one file per split, also for an empty split (0 files could not be loaded back)
    datasets.DatasetDict(parts).save_to_disk(str(folder), num_shards={k: 1 for k in parts})
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


def export_shards(
    data_spec: dict[str, Any], out: str | Path, data_dir: str | None = None, echo: Callable[[str], None] = print
) -> list[Path]:
    """Write every partition of ``data_spec`` as ``out/partition-<i>/``; one line per shard."""
    spec = check_data_spec(data_spec)
    if spec["name"] in EXTERNAL_DATASETS:
        raise ShardError(
            f"dataset.name={spec['name']!r}: shards hold image datasets only; "
            f"allowed values: {sorted(DATASETS) + list(FOLDER_SOURCES)}"
        )
    info = source_info(spec, data_dir)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ShardError(f"out={out}: exists and is not an empty folder; choose a new folder")
    written = []
    for pid in range(spec["num_partitions"]):
        splits = {name: client_arrays(spec, pid, data_dir, name) for name in SPLITS}
        manifest = make_manifest(spec, pid, splits, info)
        folder = write_shard(partition_dir(out, pid), splits, manifest)
        counts = {name: manifest["splits"][name]["num_examples"] for name in SPLITS}
        echo(
            f"{folder}: {counts['train']} train + {counts['heldout']} held-out examples, "
            f"classes {manifest['splits']['train']['class_counts']}"
        )
        written.append(folder)
    echo(f"wrote {len(written)} shards of {spec['name']} into {out}")
    return written


# --------------------------------------------------------------------------- loading


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The shard's manifest, with the keys a node needs checked (ShardError naming the folder)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{folder}: not a shard (no {MANIFEST}); export one with "
            f"`python -m fedhm_flwr.ops.deploy.shard_export <overrides> out=DIR` (docs/DEPLOY.md, Shard format)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path}: unreadable manifest ({exc})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise ShardError(f"{path}: manifest lacks {missing} (required: {list(REQUIRED_KEYS)})")
    if manifest["format"] != FORMAT or manifest["format_version"] != FORMAT_VERSION:
        raise ShardError(
            f"{path}: format {manifest['format']!r} version {manifest['format_version']!r}; "
            f"this code reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    return manifest


def _split_entry(folder: Path, manifest: dict[str, Any], split: str) -> dict[str, Any]:
    entry = manifest["splits"].get(split) if isinstance(manifest["splits"], dict) else None
    if not isinstance(entry, dict) or "sha256" not in entry or "num_examples" not in entry:
        raise ShardError(f"{folder / MANIFEST}: splits.{split} needs num_examples and sha256")
    return entry


def _read_split(folder: Path, manifest: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    """The split's arrays as saved (datasets' Arrow files), checked against the manifest."""
    import datasets

    entry = _split_entry(folder, manifest, split)
    try:
        ds = datasets.Dataset.load_from_disk(str(folder / split))
        images = ds.with_format("numpy", columns=["image"], dtype=np.uint8)[:]["image"]
        labels = ds.with_format("numpy", columns=["label"], dtype=np.int64)[:]["label"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ShardError(f"{folder}: split {split!r} cannot be read ({type(exc).__name__}: {exc})") from None
    c, size = int(manifest["in_channels"]), int(manifest["image_size"])
    images = np.asarray(images, dtype=np.uint8).reshape(-1, size, size, c) if len(labels) == 0 else images
    if images.shape[1:] != (size, size, c) or len(images) != len(labels):
        raise ShardError(
            f"{folder}: split {split!r} holds images {images.shape} / {len(labels)} labels; "
            f"the manifest says (N, {size}, {size}, {c})"
        )
    if len(labels) != int(entry["num_examples"]) or checksum(images, labels) != entry["sha256"]:
        raise ShardError(
            f"{folder}: split {split!r} does not match the manifest's checksum "
            f"(num_examples / sha256): the shard is corrupted; export it again"
        )
    if len(labels) and not (0 <= labels.min() and labels.max() < int(manifest["num_classes"])):
        raise ShardError(f"{folder}: split {split!r} has labels outside 0..{manifest['num_classes'] - 1}")
    return images, labels


def shard_arrays(folder: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 NHWC, labels int64)`` of a shard's split, checksum verified (cached per process)."""
    folder = Path(folder).expanduser().resolve()
    if split not in SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed values: {list(SPLITS)}")
    manifest = read_manifest(folder)
    stat = (folder / MANIFEST).stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    key = (str(folder), split)
    with _LOCK:
        hit = _VERIFIED.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        arrays = _read_split(folder, manifest, split)
        for a in arrays:
            a.setflags(write=False)
        _VERIFIED[key] = (stamp, arrays)
        return arrays


def shard_info(manifest: dict[str, Any]) -> DatasetInfo:
    """The dataset facts a node needs (shape, classes, normalisation), from a manifest."""
    return DatasetInfo(
        str(manifest["dataset"]),
        int(manifest["num_classes"]),
        int(manifest["in_channels"]),
        int(manifest["image_size"]),
        tuple(float(m) for m in manifest["mean"]),
        tuple(float(s) for s in manifest["std"]),
        0,
        0,
    )


def verify_shard(folder: str | Path) -> dict[str, Any]:
    """Check a shard completely (manifest, both splits' checksums); return its manifest."""
    for split in SPLITS:
        shard_arrays(folder, split)
    return read_manifest(folder)


def load_shard(folder: str | Path, split: str = "train", augment: bool = False) -> ImageTensorDataset:
    """One split of a shard as the dataset type ``client_dataset`` returns (normalised with the
    manifest's mean/std; CIFAR augmentation when ``augment``), after verifying its checksum."""
    images, labels = shard_arrays(folder, split)
    return image_dataset(images, labels, shard_info(read_manifest(folder)), augment)
