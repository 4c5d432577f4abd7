"""The per-process caches of loaded arrays, partitions and measured dataset facts (in simulation
every client of a worker process reads the same data), and the one lock guarding them."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from fedhm_flwr.data.catalog import DatasetInfo

LOCK = threading.RLock()
ARRAY_CACHE: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
PARTITION_CACHE: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = {}
INFO_CACHE: dict[tuple[Any, ...], DatasetInfo] = {}  # folder sources: facts measured on the data


def clear_caches() -> None:
    """Forget every array and partition cached in this process (tests, memory)."""
    with LOCK:
        ARRAY_CACHE.clear()
        PARTITION_CACHE.clear()
        INFO_CACHE.clear()


def readonly(a: np.ndarray) -> np.ndarray:
    """``a``, marked read-only (cached arrays are shared: copy before modifying)."""
    a.setflags(write=False)
    return a
