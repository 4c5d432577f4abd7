"""What a client and the server get from a data spec: a partition's indices, arrays, labels
and torch datasets, and the test set."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from fedhm_flwr.data import text
from fedhm_flwr.data.catalog import EXTERNAL_DATASETS
from fedhm_flwr.data.partitioning import STREAM_TEST_SUBSET, holdout_split, seeded_subset
from fedhm_flwr.data.sources import partition_indices, source_arrays, source_info
from fedhm_flwr.data.spec import check_client_split, check_data_spec, check_partition_id
from fedhm_flwr.data.tensors import ImageTensorDataset, image_dataset, to_normalised_tensor


def client_indices(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> np.ndarray:
    """Indices into the full training arrays of one split (:data:`CLIENT_SPLITS`) of a partition."""
    spec = check_data_spec(data_spec)
    pid = check_partition_id(partition_id, spec["num_partitions"])
    idx = partition_indices(spec, data_dir)[pid]
    train, heldout = holdout_split(len(idx), spec["holdout"], spec["seed"], pid)
    return idx[train if check_client_split(split) == "train" else heldout]


def client_arrays(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 NHWC, labels int64)`` of one split of a partition, in the partition's order.

    Exactly the examples :func:`client_dataset` turns into tensors (what a shard holds).
    """
    spec = check_data_spec(data_spec)
    images, labels = source_arrays(spec, "train", data_dir)
    idx = client_indices(spec, partition_id, data_dir, split)
    return images[idx], labels[idx]


def client_size(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> int:
    """How many examples one split of a partition holds (what a node reports in its node info);
    loads the source once per process, as training would, but builds no tensors for image sources."""
    spec = check_data_spec(data_spec)
    if spec["name"] in EXTERNAL_DATASETS:
        return len(text.client_dataset(spec, partition_id, data_dir, split))
    return len(client_indices(spec, partition_id, data_dir, split))


def client_labels(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """Labels (int64) of partition ``partition_id``, without building image tensors."""
    spec = check_data_spec(data_spec)
    pid = check_partition_id(partition_id, spec["num_partitions"])
    _, labels = source_arrays(spec, "train", data_dir)
    return labels[partition_indices(spec, data_dir)[pid]]


def partition_summary(
    data_spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Per partition: ``{"partition_id", "size", "num_classes_present", "class_counts"}``.

    ``class_counts`` is a list of length ``num_classes`` (JSON-friendly, for logs).
    """
    spec = check_data_spec(data_spec)
    num_classes = source_info(spec, data_dir).num_classes
    _, labels = source_arrays(spec, "train", data_dir)
    out = []
    for pid, idx in enumerate(partition_indices(spec, data_dir)):
        counts = np.bincount(labels[idx], minlength=num_classes)
        out.append(
            {
                "partition_id": pid,
                "size": int(len(idx)),
                "num_classes_present": int((counts > 0).sum()),
                "class_counts": [int(c) for c in counts],
            }
        )
    return out


def client_dataset(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> ImageTensorDataset | text.TokenDataset:
    """One split of partition ``partition_id`` as a torch Dataset.

    ``split`` is "train" (what the node trains on) or "heldout" (the seeded fraction
    ``data_spec["holdout"]`` of the partition it keeps for evaluation, see
    :func:`holdout_split`); with holdout 0, "train" is the whole partition. Normalised
    float32 NCHW images, int64 labels; CIFAR training augmentation when
    ``data_spec["augment"]``. ValueError naming ``partition-id`` when it is not in
    ``0..num_partitions-1``.
    """
    spec = check_data_spec(data_spec)
    if spec["name"] in EXTERNAL_DATASETS:
        return text.client_dataset(spec, partition_id, data_dir, split)
    images, labels = client_arrays(spec, partition_id, data_dir, split)
    return image_dataset(images, labels, source_info(spec, data_dir), spec["augment"])


def test_dataset(
    data_spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None
) -> ImageTensorDataset | text.TokenDataset:
    """The test split (normalised, no augmentation), seeded subset if ``max_test_examples``."""
    spec = check_data_spec(data_spec)
    if spec["name"] in EXTERNAL_DATASETS:
        return text.test_dataset(spec, data_dir)
    info = source_info(spec, data_dir)
    images, labels = source_arrays(spec, "test", data_dir)
    subset = seeded_subset(len(labels), spec["max_test_examples"], spec["seed"], STREAM_TEST_SUBSET)
    if subset is not None:
        images, labels = images[subset], labels[subset]
    return ImageTensorDataset(
        to_normalised_tensor(images, info),
        torch.from_numpy(np.array(labels, dtype=np.int64)),
        info.num_classes,
    )


# pytest would otherwise try to collect ``test_dataset`` when imported into a test module.
test_dataset.__test__ = False  # type: ignore[attr-defined]
