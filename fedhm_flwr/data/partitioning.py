"""Partitions (flwr-datasets' partitioners), seeded subsets and the per-partition held-out split; the
check that a run's nodes can each be given a partition (:func:`partition_problem`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.data.cache import LOCK, PARTITION_CACHE, WORK, disk_cache, readonly
from fedhm_flwr.data.spec import CLASS_ASSIGNMENTS, PARTITION_SCHEMES, check_int

# Independent random streams derived from the spec's seed (SeedSequence entropy).
STREAM_TRAIN_SUBSET = 1
STREAM_TEST_SUBSET = 2
STREAM_PARTITION_ORDER = 3
STREAM_HOLDOUT = 4


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

    Each array is sorted, int64 and read-only; results are cached per process and on disk
    (:func:`read_partitions`: the simulation's workers read what the launcher's check computed).
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(f"partition.scheme: unknown scheme {scheme!r}; allowed values: {list(PARTITION_SCHEMES)}")
    n = check_int("partition.num_partitions", num_partitions, 1)
    if n > len(labels):
        raise ValueError(f"partition.num_partitions ({n}) exceeds the number of examples ({len(labels)})")
    seed = check_int("partition.seed", seed, 0)
    alpha = float(alpha)
    if scheme == "dirichlet" and not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"partition.alpha must be a finite number > 0, got {alpha}")
    cpp = check_int("partition.classes_per_partition", classes_per_partition, 1)
    num_unique = len(np.unique(labels))
    if scheme == "pathological" and cpp > num_unique:
        raise ValueError(
            f"partition.classes_per_partition ({cpp}) exceeds the number of classes present ({num_unique})"
        )
    if class_assignment not in CLASS_ASSIGNMENTS:
        raise ValueError(
            f"partition.class_assignment: unknown value {class_assignment!r}; allowed values: {list(CLASS_ASSIGNMENTS)}"
        )
    min_size = check_int("partition.min_partition_size", min_partition_size, 0)

    # Only the parameters the scheme uses go into the key.
    params: tuple[Any, ...] = (scheme, n, seed)
    if scheme == "dirichlet":
        params += (alpha, min_size)
    elif scheme == "pathological":
        params += (cpp, class_assignment)
    digest = hashlib.sha1(np.ascontiguousarray(labels).tobytes()).hexdigest()
    key = (digest, labels.dtype.str, len(labels)) + params
    with LOCK:
        hit = PARTITION_CACHE.get(key)
    if hit is None:
        hit = read_partitions(key, len(labels), n)
        if hit is not None:
            with LOCK:
                PARTITION_CACHE[key] = hit
    if hit is not None:
        return list(hit)
    out = _partition(labels, n, scheme, seed, alpha, cpp, class_assignment, min_size)
    with LOCK:
        PARTITION_CACHE[key] = out
    write_partitions(key, out)
    return list(out)


def _partition(
    labels: np.ndarray,
    n: int,
    scheme: str,
    seed: int,
    alpha: float,
    cpp: int,
    class_assignment: str,
    min_size: int,
) -> tuple[np.ndarray, ...]:
    """:func:`partition`'s work, validated arguments, no cache: flwr-datasets' partitioner."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    # Seeded row order: the partitioners see the labels in this order and give back
    # row numbers, which ``order`` maps to indices into ``labels``.
    order = np.random.default_rng([seed, STREAM_PARTITION_ORDER]).permutation(len(labels))
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
            class_assignment_mode=class_assignment,
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
                f"partition.alpha={alpha:g} could not give each of {n} partitions at least {min_size} "
                f"of {len(labels)} examples in 10 tries: raise partition.alpha, use fewer partitions "
                "(num_clients) or more examples"
            ) from exc
        raise
    if not all(isinstance(r, np.ndarray) for r in rows):  # pragma: no cover
        raise TypeError(
            "flwr-datasets partitioner did not go through Dataset.select(); "
            "_label_dataset needs updating for this flwr-datasets version"
        )
    WORK["partition"] += 1
    return tuple(readonly(np.sort(order[r])) for r in rows)


#: what decides a partition besides its key: the partitioners' code and the random generators'
_PARTITION_CODE = ("flwr-datasets", "datasets", "numpy")


def _partition_file(key: tuple[Any, ...]) -> Path:
    """The disk cache's file of a partition key (and of the versions of the code that computes it)."""
    versions: list[str | None] = []
    for dist in _PARTITION_CODE:
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            versions.append(None)
    name = hashlib.sha256(json.dumps([list(key), versions]).encode()).hexdigest()
    return disk_cache("partitions") / f"{name}.npz"


def read_partitions(key: tuple[Any, ...], length: int, count: int) -> tuple[np.ndarray, ...] | None:
    """The ``count`` partitions of ``length`` examples of ``key`` (:func:`partition`'s) from the disk
    cache: computed once per machine, read by every later process (the launcher's check computes them
    first; the simulation's workers then import no flwr-datasets). None when absent, unreadable or not
    what the key describes (sizes, dtype, order, range): computed again then."""
    path = _partition_file(key)
    try:
        with np.load(path, allow_pickle=False) as saved:
            sizes, flat = saved["sizes"], saved["indices"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if (
        sizes.dtype != np.int64
        or flat.dtype != np.int64
        or sizes.shape != (count,)
        or (sizes < 0).any()
        or int(sizes.sum()) != len(flat)
        or len(flat) > length
        or (len(flat) and (flat.min() < 0 or flat.max() >= length))
    ):
        return None
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    if any((np.diff(p) <= 0).any() for p in parts):
        return None
    WORK["partition-read"] += 1
    return tuple(readonly(p.copy()) for p in parts)


def write_partitions(key: tuple[Any, ...], parts: tuple[np.ndarray, ...]) -> None:
    """Keep ``parts`` in the disk cache (:func:`read_partitions`); written whole or not at all, and
    quietly not where the cache cannot be written (a read-only home)."""
    path = _partition_file(key)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        np.savez_compressed(tmp, sizes=sizes, indices=flat.astype(np.int64, copy=False))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def subset_partition(labels: np.ndarray, spec: dict[str, Any]) -> list[np.ndarray]:
    """The partitions of a validated data spec over a whole training split's ``labels``, as every node
    computes them: the seeded subset (``max_train_examples``) first, then :func:`partition`; one sorted,
    read-only array of indices into ``labels`` per partition."""
    subset = seeded_subset(len(labels), spec["max_train_examples"], spec["seed"], STREAM_TRAIN_SUBSET)
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
    return parts if subset is None else [readonly(subset[p]) for p in parts]


def partition_problem(labels: np.ndarray, spec: dict[str, Any]) -> str | None:
    """Why the nodes of a validated data spec cannot each be given a partition holding an example
    (:func:`subset_partition` fails, or leaves a partition empty); None when they can."""
    try:
        parts = subset_partition(labels, spec)
    except ValueError as exc:
        return str(exc)
    empty = [pid for pid, part in enumerate(parts) if len(part) == 0]
    if empty:
        return f"{len(empty)} of the {len(parts)} partitions would hold no example (partition-id {empty[0]} first)"
    return None


def most_partitions(labels: np.ndarray, spec: dict[str, Any]) -> int | None:
    """The largest number of partitions below ``spec["num_partitions"]`` that :func:`partition_problem`
    accepts, searched by halving (the partitioners' outcome grows worse with the count); None when
    not even one partition can be made."""
    lo, hi = 0, spec["num_partitions"] - 1  # lo: known to work (0: none yet); hi: the largest untried
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if partition_problem(labels, {**spec, "num_partitions": mid}) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def seeded_subset(n: int, k: int, seed: int, stream: int) -> np.ndarray | None:
    """Sorted random subset of ``range(n)`` of size ``k`` (None = take all)."""
    if k <= 0 or k >= n:
        return None
    rng = np.random.default_rng([seed, stream])
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def holdout_split(num_examples: int, fraction: float, seed: int, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Split positions ``0..num_examples-1`` of one partition into (train, heldout).

    ``round(fraction * num_examples)`` positions, drawn by a plain permutation seeded by
    (``seed``, partition id), are held out, capped so that at least one example trains; both
    arrays are sorted (the partition's order is kept), disjoint and cover every position.
    ``fraction = 0`` holds out nothing: train is ``arange(num_examples)``.
    """
    n = check_int("partition size", num_examples, 0)
    fraction = float(fraction)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"evaluation.holdout must be a fraction in [0, 1), got {fraction}")
    k = min(int(round(fraction * n)), max(n - 1, 0))
    if k == 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    perm = np.random.default_rng([seed, STREAM_HOLDOUT, partition_id]).permutation(n)
    return np.sort(perm[k:]).astype(np.int64), np.sort(perm[:k]).astype(np.int64)


#: the fixed seed of a folder source's test split (the same test set for every run seed)
SOURCE_SPLIT_SEED = 20261123


def fraction_split(labels: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Stratified (train, test) positions of ``labels``: ``round(fraction * n_c)`` examples of each
    class ``c``, drawn with the fixed :data:`SOURCE_SPLIT_SEED`, are the test set. Both sorted,
    disjoint, covering every position."""
    labels = np.asarray(labels, dtype=np.int64)
    is_test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        drawn = np.random.default_rng([SOURCE_SPLIT_SEED, int(c)]).permutation(members)
        is_test[drawn[: int(round(float(fraction) * len(members)))]] = True
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)
