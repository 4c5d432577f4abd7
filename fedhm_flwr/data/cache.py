"""The per-process caches of loaded arrays, partitions and measured dataset facts (in simulation
every client of a worker process reads the same data), the one lock guarding them, the count of the
work they saved, and where the caches on disk live (``$FEDHM_CACHE``, default ``~/.cache/fedhm-flwr``)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fedhm_flwr.data.catalog import DatasetInfo

LOCK = threading.RLock()
ARRAY_CACHE: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
PARTITION_CACHE: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = {}
INFO_CACHE: dict[tuple[Any, ...], DatasetInfo] = {}  # folder sources: facts measured on the data
#: the work this process did that the caches are there to do once (a count per kind, never a time):
#: ``decode`` a dataset split decoded from its files, ``partition`` partitions computed (flwr-datasets'
#: partitioners), ``partition-read`` partitions read back from the disk cache
WORK: Counter[str] = Counter()
CACHE_ENV = "FEDHM_CACHE"


def disk_cache(kind: str) -> Path:
    """The folder of one kind of on-disk cache: ``$FEDHM_CACHE/<kind>`` (default ``~/.cache/fedhm-flwr``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fedhm-flwr") / kind


def clear_caches() -> None:
    """Forget every array and partition cached in this process (tests, memory); the disk cache stays."""
    with LOCK:
        ARRAY_CACHE.clear()
        PARTITION_CACHE.clear()
        INFO_CACHE.clear()


def readonly(a: np.ndarray) -> np.ndarray:
    """``a``, marked read-only (cached arrays are shared: copy before modifying)."""
    a.setflags(write=False)
    return a
