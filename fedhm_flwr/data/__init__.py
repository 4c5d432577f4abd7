"""Datasets, partitions and per-client data for fedhm-flwr.

Clients are *told, not configured*: the server puts a **data spec** (a plain,
JSON-serialisable dict) into every message; a client only knows its own data
location (``data_dir``, may be ``None``) and its ``partition-id`` from its node
config. Every function here is a pure function of (data spec, partition id,
data location), so all clients and the server derive the same partitions.

Data spec schema
----------------
``make_data_spec(...)`` builds one and :func:`check_data_spec` validates one
and fills the defaults. Keys (``*`` = required)::

    name*                 str    "fashion_mnist" | "cifar10" | "cifar100" | "sentiment" |
                                 "imagefolder" | "hf_disk"
    num_partitions*       int    number of clients the training set is split into (>= 1)
    scheme                str    "iid" | "dirichlet" | "pathological"      (default "iid")
    alpha                 float  Dirichlet concentration, > 0               (default 0.5)
    classes_per_partition int    classes per client for "pathological"     (default 2)
    seed                  int    >= 0; seeds subsets and partitions         (default 0)
    max_train_examples    int    0 = all; > 0: seeded random subset of the training
                                 set taken BEFORE partitioning (quick runs) (default 0)
    max_test_examples     int    0 = all; > 0: seeded random test subset    (default 0)
    augment               bool   CIFAR: random crop 32 pad 4 + horizontal flip on
                                 client training data; Fashion-MNIST: none (default False)
    download              bool   CIFAR only: let torchvision download when the files
                                 are missing (never used by tests)          (default False)
    class_assignment      str    "pathological" only: "deterministic" (client i gets
                                 classes i, i+1, ... mod C) | "random" (seeded) |
                                 "first-deterministic"                      (default "deterministic")
    min_partition_size    int    "dirichlet" only: resample (at most 10 tries, as
                                 flwr-datasets does) until every client has at least
                                 this many examples                         (default 2)
    holdout               float  fraction of each partition held out (seeded by seed and
                                 partition id) for client-side evaluation, in [0, 1):
                                 client_dataset(..., split="train" | "heldout") (default 0)

The folder sources (``name`` "imagefolder" | "hf_disk": your own data) take these keys too, and
only they do (:data:`fedhm_flwr.data.spec.SOURCE_DEFAULTS`; config ``dataset.<key>``)::

    path*                 str    the folder: torchvision ImageFolder layout / datasets save_to_disk
    image_size            int    images are scaled and centre-cropped to this square  (default 32)
    channels              int    1 (grayscale) | 3 (RGB)                               (default 3)
    test_fraction         float  without a test split: this share of each class, drawn with a
                                 fixed seed, is the test set                           (default 0.2)
    train_split           str    the training sub-folder / split                      (default "train")
    test_split            str    the test one; None: test | val | validation if present (default None)
    image_column          str    hf_disk only: the images' column                     (default "image")
    label_column          str    hf_disk only: the labels' column                     (default "label")

Unknown keys are refused (a typo would otherwise silently change an experiment).

Array layout
------------
:func:`load_arrays` returns images as ``uint8`` **NHWC** ``(N, H, W, C)`` (what
torchvision's CIFAR ``.data`` holds; Fashion-MNIST gets ``C = 1``) and labels as
``int64``. The torch datasets returned by :func:`client_dataset` and
:func:`test_dataset` hold **NCHW float32** tensors normalised with the dataset's
mean/std. Labels of a partition are available without building tensors through
:func:`client_labels`, and on a built dataset as ``ds.labels`` (int64 tensor) /
``ds.label_array()`` (numpy).

Where the data comes from
-------------------------
* Fashion-MNIST: the four IDX ``.gz`` files of the Debian package
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``), read with
  numpy (see :func:`fedhm_flwr.data.idx.read_idx`). Search order: ``data_dir`` if given (only
  there), else ``$FEDHM_DATA_DIR`` then the Debian path.
* CIFAR-10/100: ``torchvision.datasets.CIFAR10/100(root, train, download)``,
  root = ``data_dir`` or ``$FEDHM_DATA_DIR`` or ``~/.cache/fedhm-flwr/data``;
  nothing is downloaded unless the spec says ``download: true``.
* Your own data: ``path`` (or a node's ``data_dir``, a full copy at another place), read by
  :mod:`fedhm_flwr.data.imagefolder` or :mod:`fedhm_flwr.data.hf_disk`, decoded once per process;
  mean/std are measured on the training split.

A node of a real deployment may instead hold only its own partition as a **shard**
(:mod:`fedhm_flwr.data.shards`); where the files lie is in :mod:`fedhm_flwr.data.files`.

Loaded arrays and partitions are cached per process: in simulation every
client of a worker process calls these functions.

Modules
-------
``catalog`` (what is known of each dataset before reading it), ``cache`` (the per-process caches),
``spec`` (validation), ``partitioning`` (flwr-datasets partitioners, subsets, held-out split),
``sources`` (:func:`dataset_info`, :func:`load_arrays`, :func:`source_arrays`), one module per
source (``idx``, ``cifar``, ``imagefolder``, ``hf_disk``, ``text``), ``tensors`` (the torch Dataset),
``clients`` (a partition's data and the test set from a spec), ``files`` (where files lie; the pre-start check),
``layouts`` (the layout of your own data's folders) and
``shards``. This package imports its submodules lazily, on first use of a name (PEP 562 ``__getattr__``): importing
``fedhm_flwr.data.files``, ``.layouts`` or ``.catalog`` stays free of numpy and torch, as the launcher's data
check needs. Modules inside this package import each other directly, never through this facade.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedhm_flwr.core.errors import DataSourceError as DataSourceError

#: public name -> the submodule defining it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("DATA_DIR_ENV", "DEFAULT_DOWNLOAD_ROOT", "FASHION_MNIST_SYSTEM_DIR"), "files"),
    **dict.fromkeys(
        ("CLASS_NAMES", "DATASETS", "EXTERNAL_DATASETS", "FOLDER_SOURCES", "SPLITS", "TEXT_DATASETS", "DatasetInfo"),
        "catalog",
    ),
    **dict.fromkeys(("clear_caches",), "cache"),
    **dict.fromkeys(("class_names", "dataset_info", "load_arrays", "source_arrays", "source_info"), "sources"),
    **dict.fromkeys(
        (
            "CLASS_ASSIGNMENTS",
            "CLIENT_SPLITS",
            "DATA_SPEC_DEFAULTS",
            "PARTITION_SCHEMES",
            "SOURCE_DEFAULTS",
            "check_data_spec",
            "make_data_spec",
        ),
        "spec",
    ),
    **dict.fromkeys(("fraction_split", "holdout_split", "partition"), "partitioning"),
    **dict.fromkeys(("ImageTensorDataset", "image_dataset", "to_normalised_tensor"), "tensors"),
    **dict.fromkeys(
        (
            "client_arrays",
            "client_dataset",
            "client_indices",
            "client_labels",
            "client_size",
            "partition_indices",
            "partition_summary",
            "test_dataset",
        ),
        "clients",
    ),
}
__all__ = sorted([*_EXPORTS, "DataSourceError"])  # the error is defined in fedhm_flwr.core.errors


def __getattr__(name: str) -> Any:
    """PEP 562: the first use of a public name imports the one submodule defining it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
