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

    name*                 str    "fashion_mnist" | "cifar10" | "cifar100"
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
  numpy (see :func:`_read_idx`). Search order: ``data_dir`` if given (only
  there), else ``$FEDHM_DATA_DIR`` then the Debian path.
* CIFAR-10/100: ``torchvision.datasets.CIFAR10/100(root, train, download)``,
  root = ``data_dir`` or ``$FEDHM_DATA_DIR`` or ``~/.cache/fedhm-flwr/data``;
  nothing is downloaded unless the spec says ``download: true``.

A node of a real deployment may instead hold only its own partition as a **shard**
(:mod:`fedhm_flwr.shards`); where the files lie is in :mod:`fedhm_flwr.data_files`.

Loaded arrays and partitions are cached per process: in simulation every
client of a worker process calls these functions.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from fedhm_flwr.data_files import (
    CIFAR_ARCHIVES,
    CIFAR_FOLDERS,
    DATA_DIR_ENV,
    DEFAULT_DOWNLOAD_ROOT,
    FASHION_FILES,
    FASHION_MNIST_SYSTEM_DIR,
    cifar_root,
    fashion_candidate_dirs,
    fashion_files,
)

__all__ = [
    "CLIENT_SPLITS",
    "DATASETS",
    "DATA_DIR_ENV",
    "DATA_SPEC_DEFAULTS",
    "DEFAULT_DOWNLOAD_ROOT",
    "FASHION_MNIST_SYSTEM_DIR",
    "PARTITION_SCHEMES",
    "DatasetInfo",
    "ImageTensorDataset",
    "check_data_spec",
    "clear_caches",
    "client_arrays",
    "client_dataset",
    "client_indices",
    "client_labels",
    "dataset_info",
    "holdout_split",
    "image_dataset",
    "load_arrays",
    "make_data_spec",
    "partition",
    "partition_indices",
    "partition_summary",
    "test_dataset",
]

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
EXTERNAL_DATASETS: dict[str, str] = {"sentiment": "fedhm_flwr.text_data"}


def _external(name: Any) -> Any:
    """The module serving dataset ``name`` when it is not an image dataset of this file."""
    module = EXTERNAL_DATASETS.get(name) if isinstance(name, str) else None
    return importlib.import_module(module) if module else None


PARTITION_SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "pathological")
CLASS_ASSIGNMENTS: tuple[str, ...] = ("deterministic", "random", "first-deterministic")
SPLITS: tuple[str, ...] = ("train", "test")

#: the splits of one partition: what a node trains on, and what it holds out for evaluation
CLIENT_SPLITS: tuple[str, ...] = ("train", "heldout")

# Independent random streams derived from the spec's seed (SeedSequence entropy).
_STREAM_TRAIN_SUBSET = 1
_STREAM_TEST_SUBSET = 2
_STREAM_PARTITION_ORDER = 3
_STREAM_HOLDOUT = 4


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


# --------------------------------------------------------------------------- loading


def _read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (``.gz`` or plain) into a numpy array.

    Written by hand on purpose: IDX is a 4-byte magic (0, 0, dtype code, ndim),
    ndim big-endian uint32 sizes, then the raw data. torchvision's FashionMNIST
    class cannot read the Debian files where they lie: it insists on its own
    ``<root>/FashionMNIST/raw/`` layout with *uncompressed*, md5-checked files (and
    its ``read_sn3_pascalvincent_tensor`` only opens uncompressed files), so using it
    would mean copying and gunzipping 30 MB first. numpy + gzip is ten lines.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = data[2], data[3]
    if code not in dtypes or ndim < 1:
        raise ValueError(f"{path}: unsupported IDX type code {code:#x} / ndim {ndim}")
    header = 4 + 4 * ndim
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(dtypes[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: IDX payload has {len(data) - header} bytes, header says {expected}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _load_fashion_mnist(split: str, data_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
    img_stem, lbl_stem = FASHION_FILES[split]
    found = fashion_files(split, data_dir)
    if found is not None:
        img, lbl = found
        images = _read_idx(img)
        labels = _read_idx(lbl).astype(np.int64)
        if images.ndim != 3 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"{img}, {lbl}: inconsistent Fashion-MNIST files")
        return images[..., None], labels  # NHWC, C = 1
    looked = fashion_candidate_dirs(data_dir)
    where = "\n  ".join(str(p) for p in looked)
    raise FileNotFoundError(
        f"Fashion-MNIST ({split}) not found: need {img_stem}[.gz] and {lbl_stem}[.gz]. "
        f"Looked in:\n  {where}\n"
        f"Install them with `apt-get install dataset-fashion-mnist` (puts them in "
        f"{FASHION_MNIST_SYSTEM_DIR}), or set data_dir / ${DATA_DIR_ENV} to a folder "
        f"that holds them."
    )


def _load_cifar(
    name: str, split: str, data_dir: str | None, download: bool
) -> tuple[np.ndarray, np.ndarray]:
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
            images, labels = _load_fashion_mnist(split, d)
        else:
            images, labels = _load_cifar(name, split, d, download)
        if images.shape[1:] != (info.image_size, info.image_size, info.in_channels):
            raise ValueError(f"{name}/{split}: unexpected image shape {images.shape}")
        out = (_readonly(images), _readonly(labels))
        _ARRAY_CACHE[key] = out
        return out


# --------------------------------------------------------------------------- partitions


def _check_int(field: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


_LABEL_DATASET_CLS: Any = None


def _label_dataset(labels: np.ndarray) -> Any:
    """An in-memory ``datasets.Dataset`` with one ``label`` column, for the partitioners.

    A thin subclass with two shortcuts, because with datasets 4.x the partitioners
    are slow on 60k rows (tens of seconds on a small machine): ``ds["label"]`` is a
    lazy ``Column`` that ``np.asarray`` walks row by row, and ``select()`` hashes the
    index list with dill for its fingerprint. Here a column read returns the numpy
    array, and ``select(indices)`` (also reached through ``shard``) returns the
    selected row numbers instead of a copied Dataset: we only need the indices.
    The partitioning itself (class assignment, Dirichlet sampling, shuffling) is
    entirely flwr-datasets'.
    """
    global _LABEL_DATASET_CLS
    if _LABEL_DATASET_CLS is None:
        import datasets

        class _LabelDataset(datasets.Dataset):  # type: ignore[misc]
            def __getitem__(self, key: Any) -> Any:
                if isinstance(key, str):
                    return self.data.column(key).to_numpy()
                return super().__getitem__(key)

            def select(self, indices: Any, *args: Any, **kwargs: Any) -> Any:
                return np.asarray(indices, dtype=np.int64)

        _LABEL_DATASET_CLS = _LabelDataset
    return _LABEL_DATASET_CLS.from_dict({"label": np.asarray(labels, dtype=np.int64)})


def partition(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str,
    seed: int,
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    class_assignment: str = "deterministic",
    min_partition_size: int = 2,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` into ``num_partitions`` disjoint index arrays.

    Uses flwr-datasets' partitioners on an in-memory ``datasets.Dataset`` holding
    the labels (no download, no disk; see :func:`_label_dataset`). The rows are first put
    in a seeded random order, so that the result depends on ``seed`` for every
    scheme (``IidPartitioner`` shards contiguously and ``PathologicalPartitioner``
    splits each class in dataset order).

    * ``"iid"``: ``IidPartitioner`` (equal-size shards of the shuffled rows; covers all).
    * ``"dirichlet"``: ``DirichletPartitioner(alpha, min_partition_size,
      self_balancing=False, seed)`` over ``label`` (covers all).
    * ``"pathological"``: ``PathologicalPartitioner(classes_per_partition,
      class_assignment, seed)``; each partition holds at most that many classes;
      classes assigned to nobody are left out.

    Each array is sorted, int64 and read-only; results are cached per process.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(
            f"partition.scheme: unknown scheme {scheme!r}; allowed values: "
            f"{list(PARTITION_SCHEMES)}"
        )
    n = _check_int("partition.num_partitions", num_partitions, 1)
    if n > len(labels):
        raise ValueError(
            f"partition.num_partitions ({n}) exceeds the number of examples ({len(labels)})"
        )
    seed = _check_int("partition.seed", seed, 0)
    alpha = float(alpha)
    if scheme == "dirichlet" and not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"partition.alpha must be a finite number > 0, got {alpha}")
    cpp = _check_int("partition.classes_per_partition", classes_per_partition, 1)
    num_unique = len(np.unique(labels))
    if scheme == "pathological" and cpp > num_unique:
        raise ValueError(
            f"partition.classes_per_partition ({cpp}) exceeds the number of classes "
            f"present ({num_unique})"
        )
    if class_assignment not in CLASS_ASSIGNMENTS:
        raise ValueError(
            f"partition.class_assignment: unknown value {class_assignment!r}; allowed "
            f"values: {list(CLASS_ASSIGNMENTS)}"
        )
    min_size = _check_int("partition.min_partition_size", min_partition_size, 0)

    # Only the parameters the scheme uses go into the key.
    params: tuple[Any, ...] = (scheme, n, seed)
    if scheme == "dirichlet":
        params += (alpha, min_size)
    elif scheme == "pathological":
        params += (cpp, class_assignment)
    digest = hashlib.sha1(np.ascontiguousarray(labels).tobytes()).hexdigest()
    key = (digest, labels.dtype.str, len(labels)) + params
    with _LOCK:
        hit = _PARTITION_CACHE.get(key)
    if hit is not None:
        return list(hit)

    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    # Seeded row order: the partitioners see the labels in this order and give back
    # row numbers, which ``order`` maps to indices into ``labels``.
    order = np.random.default_rng([seed, _STREAM_PARTITION_ORDER]).permutation(len(labels))
    ds = _label_dataset(labels[order])
    if scheme == "iid":
        partitioner: Any = IidPartitioner(num_partitions=n)
    elif scheme == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=n,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_size,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    else:
        partitioner = PathologicalPartitioner(
            num_partitions=n,
            partition_by="label",
            num_classes_per_partition=cpp,
            class_assignment_mode=class_assignment,  # type: ignore[arg-type]
            shuffle=True,
            seed=seed,
        )
    partitioner.dataset = ds
    try:
        with warnings.catch_warnings():
            # Dirichlet warns on every rejected sample; the final failure is raised.
            warnings.filterwarnings("ignore", message="The specified min_partition_size")
            rows = [partitioner.load_partition(i) for i in range(n)]
    except ValueError as exc:
        if scheme == "dirichlet":
            raise ValueError(
                f"partition.alpha={alpha} with partition.num_partitions={n} could not "
                f"give every partition >= {min_size} examples (min_partition_size) "
                f"in 10 tries; raise alpha, lower num_partitions or "
                f"min_partition_size ({exc})"
            ) from exc
        raise
    if not all(isinstance(r, np.ndarray) for r in rows):  # pragma: no cover
        raise TypeError(
            "flwr-datasets partitioner did not go through Dataset.select(); "
            "_label_dataset needs updating for this flwr-datasets version"
        )
    parts = [np.sort(order[r]) for r in rows]
    out = tuple(_readonly(p) for p in parts)
    with _LOCK:
        _PARTITION_CACHE[key] = out
    return list(out)


# --------------------------------------------------------------------------- data spec

DATA_SPEC_DEFAULTS: dict[str, Any] = {
    "scheme": "iid",
    "alpha": 0.5,
    "classes_per_partition": 2,
    "seed": 0,
    "max_train_examples": 0,
    "max_test_examples": 0,
    "augment": False,
    "download": False,
    "class_assignment": "deterministic",
    "min_partition_size": 2,
    "holdout": 0.0,  # fraction of each partition held out (seeded) for client-side evaluation
}
_REQUIRED_KEYS = ("name", "num_partitions")


def _check_bool(field: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{field} must be a boolean, got {value!r}")


def check_data_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate a data spec and return a new dict with defaults filled in.

    Raises ValueError naming the offending field (``dataset.name``,
    ``partition.scheme``, ...) for unknown datasets/schemes, bad values, missing
    required keys or unknown keys.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"data spec must be a dict, got {type(spec).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in spec]
    if missing:
        raise ValueError(f"data spec: missing required key(s) {missing}")
    unknown = sorted(set(spec) - set(_REQUIRED_KEYS) - set(DATA_SPEC_DEFAULTS))
    if unknown:
        raise ValueError(
            f"data spec: unknown key(s) {unknown}; allowed: "
            f"{sorted(set(_REQUIRED_KEYS) | set(DATA_SPEC_DEFAULTS))}"
        )
    out = {**DATA_SPEC_DEFAULTS, **spec}
    if out["name"] not in EXTERNAL_DATASETS:
        _info(out["name"])
    if out["scheme"] not in PARTITION_SCHEMES:
        raise ValueError(
            f"partition.scheme: unknown scheme {out['scheme']!r}; allowed values: "
            f"{list(PARTITION_SCHEMES)}"
        )
    if out["class_assignment"] not in CLASS_ASSIGNMENTS:
        raise ValueError(
            f"partition.class_assignment: unknown value {out['class_assignment']!r}; "
            f"allowed values: {list(CLASS_ASSIGNMENTS)}"
        )
    out["num_partitions"] = _check_int("partition.num_partitions", out["num_partitions"], 1)
    out["classes_per_partition"] = _check_int(
        "partition.classes_per_partition", out["classes_per_partition"], 1
    )
    out["seed"] = _check_int("partition.seed", out["seed"], 0)
    out["max_train_examples"] = _check_int(
        "dataset.max_train_examples", out["max_train_examples"], 0
    )
    out["max_test_examples"] = _check_int(
        "dataset.max_test_examples", out["max_test_examples"], 0
    )
    out["min_partition_size"] = _check_int(
        "partition.min_partition_size", out["min_partition_size"], 0
    )
    try:
        alpha = float(out["alpha"])
    except (TypeError, ValueError):
        raise ValueError(f"partition.alpha must be a number, got {out['alpha']!r}") from None
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"partition.alpha must be a finite number > 0, got {alpha}")
    out["alpha"] = alpha
    try:
        holdout = float(out["holdout"])
    except (TypeError, ValueError):
        raise ValueError(f"evaluation.holdout must be a number, got {out['holdout']!r}") from None
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"evaluation.holdout must be a fraction in [0, 1), got {holdout}")
    out["holdout"] = holdout
    out["augment"] = _check_bool("dataset.augment", out["augment"])
    out["download"] = _check_bool("dataset.download", out["download"])
    return out


def make_data_spec(name: str, num_partitions: int, **kwargs: Any) -> dict[str, Any]:
    """Build a complete, validated data spec (see the module docstring for keys)."""
    return check_data_spec({"name": name, "num_partitions": num_partitions, **kwargs})


def _check_partition_id(partition_id: Any, num_partitions: int) -> int:
    if isinstance(partition_id, bool) or not isinstance(partition_id, (int, np.integer)):
        raise ValueError(f"partition-id must be an integer, got {partition_id!r}")
    pid = int(partition_id)
    if not 0 <= pid < num_partitions:
        raise ValueError(
            f"partition-id {pid} out of range: the data spec has "
            f"num_partitions={num_partitions} (valid ids 0..{num_partitions - 1})"
        )
    return pid


def _seeded_subset(n: int, k: int, seed: int, stream: int) -> np.ndarray | None:
    """Sorted random subset of ``range(n)`` of size ``k`` (None = take all)."""
    if k <= 0 or k >= n:
        return None
    rng = np.random.default_rng([seed, stream])
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def partition_indices(
    data_spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None
) -> list[np.ndarray]:
    """Indices into the *full* training arrays, one sorted array per partition.

    Applies ``max_train_examples`` (seeded subset) first, then :func:`partition`.
    """
    spec = check_data_spec(data_spec)
    _, labels = load_arrays(spec["name"], "train", data_dir, spec["download"])
    subset = _seeded_subset(
        len(labels), spec["max_train_examples"], spec["seed"], _STREAM_TRAIN_SUBSET
    )
    sub_labels = labels if subset is None else labels[subset]
    parts = partition(
        sub_labels,
        spec["num_partitions"],
        spec["scheme"],
        spec["seed"],
        alpha=spec["alpha"],
        classes_per_partition=spec["classes_per_partition"],
        class_assignment=spec["class_assignment"],
        min_partition_size=spec["min_partition_size"],
    )
    if subset is None:
        return parts
    return [_readonly(subset[p]) for p in parts]


def holdout_split(
    num_examples: int, fraction: float, seed: int, partition_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split positions ``0..num_examples-1`` of one partition into (train, heldout).

    ``round(fraction * num_examples)`` positions, drawn by a plain permutation seeded by
    (``seed``, partition id), are held out, capped so that at least one example trains; both
    arrays are sorted (the partition's order is kept), disjoint and cover every position.
    ``fraction = 0`` holds out nothing: train is ``arange(num_examples)``.
    """
    n = _check_int("partition size", num_examples, 0)
    fraction = float(fraction)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"evaluation.holdout must be a fraction in [0, 1), got {fraction}")
    k = min(int(round(fraction * n)), max(n - 1, 0))
    if k == 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    perm = np.random.default_rng([seed, _STREAM_HOLDOUT, partition_id]).permutation(n)
    return np.sort(perm[k:]).astype(np.int64), np.sort(perm[:k]).astype(np.int64)


def _check_client_split(split: Any) -> str:
    if split not in CLIENT_SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed values: {list(CLIENT_SPLITS)}")
    return str(split)


def client_indices(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> np.ndarray:
    """Indices into the full training arrays of one split (:data:`CLIENT_SPLITS`) of a partition."""
    spec = check_data_spec(data_spec)
    pid = _check_partition_id(partition_id, spec["num_partitions"])
    idx = partition_indices(spec, data_dir)[pid]
    train, heldout = holdout_split(len(idx), spec["holdout"], spec["seed"], pid)
    return idx[train if _check_client_split(split) == "train" else heldout]


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
    images, labels = load_arrays(spec["name"], "train", data_dir, spec["download"])
    idx = client_indices(spec, partition_id, data_dir, split)
    return images[idx], labels[idx]


def client_labels(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """Labels (int64) of partition ``partition_id``, without building image tensors."""
    spec = check_data_spec(data_spec)
    pid = _check_partition_id(partition_id, spec["num_partitions"])
    _, labels = load_arrays(spec["name"], "train", data_dir, spec["download"])
    return labels[partition_indices(spec, data_dir)[pid]]


def partition_summary(
    data_spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Per partition: ``{"partition_id", "size", "num_classes_present", "class_counts"}``.

    ``class_counts`` is a list of length ``num_classes`` (JSON-friendly, for logs).
    """
    spec = check_data_spec(data_spec)
    num_classes = _info(spec["name"]).num_classes
    _, labels = load_arrays(spec["name"], "train", data_dir, spec["download"])
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


# --------------------------------------------------------------------------- torch datasets


def _to_normalised_tensor(images: np.ndarray, info: DatasetInfo) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW, ``(x / 255 - mean) / std`` per channel."""
    # astype copies (the cached arrays are read-only); then in place, one buffer.
    x = torch.from_numpy(images.transpose(0, 3, 1, 2).astype(np.float32, order="C"))
    mean = torch.tensor(info.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(info.std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.div_(255.0).sub_(mean).div_(std)


def _train_augmentation(info: DatasetInfo) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """CIFAR: random crop 32 (pad 4) + horizontal flip on a normalised CHW tensor."""
    if info.name not in ("cifar10", "cifar100"):
        return None
    from torchvision.transforms import v2

    # Pad with black (pixel value 0) as the usual pre-normalisation pipeline does.
    fill = [float(-m / s) for m, s in zip(info.mean, info.std)]
    return v2.Compose(
        [
            v2.RandomCrop(info.image_size, padding=4, fill=fill),  # type: ignore[arg-type]
            v2.RandomHorizontalFlip(),
        ]
    )


class ImageTensorDataset(Dataset):
    """In-memory image classification dataset.

    Attributes: ``images`` (float32 NCHW, normalised), ``labels`` (int64, shape (N,)),
    ``num_classes``, ``transform`` (per-sample callable on a CHW tensor, or None).
    ``__getitem__`` returns ``(image CHW float32, label 0-dim int64 tensor)``.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        num_classes: int,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError("images and labels differ in length")
        self.images = images
        self.labels = labels
        self.num_classes = num_classes
        self.transform = transform

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.labels[i]

    def label_array(self) -> np.ndarray:
        """Labels as an int64 numpy array."""
        return self.labels.numpy()

    def class_counts(self) -> np.ndarray:
        """Examples per class, length ``num_classes``."""
        return np.bincount(self.label_array(), minlength=self.num_classes)


def image_dataset(
    images: np.ndarray, labels: np.ndarray, info: DatasetInfo, augment: bool = False
) -> ImageTensorDataset:
    """uint8 NHWC images + labels -> normalised :class:`ImageTensorDataset` (CIFAR augmentation
    when ``augment``); shared by the simulation's partitions and the nodes' shards."""
    return ImageTensorDataset(
        _to_normalised_tensor(images, info),
        torch.from_numpy(np.array(labels, dtype=np.int64)),
        info.num_classes,
        _train_augmentation(info) if augment else None,
    )


def client_dataset(
    data_spec: dict[str, Any],
    partition_id: int,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> ImageTensorDataset:
    """One split of partition ``partition_id`` as a torch Dataset.

    ``split`` is "train" (what the node trains on) or "heldout" (the seeded fraction
    ``data_spec["holdout"]`` of the partition it keeps for evaluation, see
    :func:`holdout_split`); with holdout 0, "train" is the whole partition. Normalised
    float32 NCHW images, int64 labels; CIFAR training augmentation when
    ``data_spec["augment"]``. ValueError naming ``partition-id`` when it is not in
    ``0..num_partitions-1``.
    """
    spec = check_data_spec(data_spec)
    external = _external(spec["name"])
    if external is not None:
        return external.client_dataset(spec, partition_id, data_dir, split)
    images, labels = client_arrays(spec, partition_id, data_dir, split)
    return image_dataset(images, labels, _info(spec["name"]), spec["augment"])


def test_dataset(
    data_spec: dict[str, Any], data_dir: str | os.PathLike[str] | None = None
) -> ImageTensorDataset:
    """The test split (normalised, no augmentation), seeded subset if ``max_test_examples``."""
    spec = check_data_spec(data_spec)
    external = _external(spec["name"])
    if external is not None:
        return external.test_dataset(spec, data_dir)
    info = _info(spec["name"])
    images, labels = load_arrays(spec["name"], "test", data_dir, spec["download"])
    subset = _seeded_subset(
        len(labels), spec["max_test_examples"], spec["seed"], _STREAM_TEST_SUBSET
    )
    if subset is not None:
        images, labels = images[subset], labels[subset]
    return ImageTensorDataset(
        _to_normalised_tensor(images, info),
        torch.from_numpy(np.array(labels, dtype=np.int64)),
        info.num_classes,
    )


# pytest would otherwise try to collect ``test_dataset`` when imported into a test module.
test_dataset.__test__ = False  # type: ignore[attr-defined]
