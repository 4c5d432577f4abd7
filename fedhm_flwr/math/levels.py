"""Which client trains which level, and which clients train at all: pure, seeded functions.

Every draw is derived from ``(seed, round)`` alone (no hidden generator state), so a run is
reproducible and a resumed run makes the same draws as an uninterrupted one.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np


def round_rng(seed: int, server_round: int, stream: int = 0) -> np.random.Generator:
    """The generator of one round (``stream`` separates independent uses within a round)."""
    return np.random.default_rng([int(seed), int(server_round), int(stream)])


def counts_for(proportions: Sequence[float], total: int) -> list[int]:
    """Split ``total`` clients over levels by ``proportions`` (largest-remainder rounding)."""
    p = np.asarray(proportions, dtype=np.float64)
    if p.ndim != 1 or len(p) == 0 or np.any(p < 0) or p.sum() <= 0:
        raise ValueError("proportions must be non-negative with a positive sum")
    exact = p / p.sum() * total
    counts = np.floor(exact).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return counts.tolist()


def fixed_levels(partition_ids: Sequence[int], proportions: Sequence[float], seed: int) -> dict[int, int]:
    """One level index per partition for the whole run, in the configured proportions.

    The partitions are sorted, the level list (level ``i`` repeated ``counts[i]`` times) is
    shuffled with the seed, and handed out in order: the same partitions always get the same
    levels for the same seed, whatever the order in which nodes connect.
    """
    pids = sorted(int(p) for p in partition_ids)
    counts = counts_for(proportions, len(pids))
    pool = np.repeat(np.arange(len(counts)), counts)
    np.random.default_rng([int(seed), 7919]).shuffle(pool)
    return {pid: int(level) for pid, level in zip(pids, pool)}


@functools.lru_cache(maxsize=64)
def _partition_pool(num_partitions: int, proportions: tuple[float, ...], seed: int) -> tuple[int, ...]:
    by_pid = fixed_levels(range(num_partitions), proportions, seed)
    return tuple(by_pid[p] for p in range(num_partitions))


def partition_level(partition_id: int, num_partitions: int, proportions: Sequence[float], seed: int) -> int:
    """The fixed level of partition ``partition_id`` of ``num_partitions``: the run's pool of
    levels is sized by the number of partitions (a constant of the run), never by how many nodes
    happen to be connected, so a node keeps its level whoever else joins or leaves."""
    return _partition_pool(int(num_partitions), tuple(float(p) for p in proportions), int(seed))[int(partition_id)]


def hashed_level(identity: str, proportions: Sequence[float], seed: int) -> int:
    """The fixed level of a node known only by a name: a seeded hash of the name, mapped to the
    levels by their proportions (the shares hold in expectation over many nodes)."""
    digest = hashlib.sha256(f"{int(seed)}:{identity}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    p = np.asarray(proportions, dtype=np.float64)
    edges = np.cumsum(p / p.sum())
    return min(int(np.searchsorted(edges, u, side="right")), len(p) - 1)


def client_seed(seed: int, server_round: int, key: int) -> int:
    """A client's training seed for one round: 63 bits of a BLAKE2b hash of (seed, round, node key),
    with no arithmetic collisions between rounds and keys (two of a run's million seeds coincide with
    odds ~1e-7). A hash, not a SeedSequence: the server makes one per sampled node per round, and a
    SeedSequence costs ~10 µs each in a round (a tenth of the CNN's configure_train)."""
    digest = hashlib.blake2b(
        f"{int(seed)}:{int(server_round)}:{int(key)}".encode(), digest_size=8, person=b"fedhm-client"
    ).digest()
    return int.from_bytes(digest, "big") >> 1


def dynamic_levels(n: int, proportions: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Each of ``n`` sampled clients draws a level index from the proportions."""
    p = np.asarray(proportions, dtype=np.float64)
    return rng.choice(len(p), size=n, p=p / p.sum()).tolist()


def sample_clients(
    keys: Sequence[int], fraction: float, minimum: int, rng: np.random.Generator | Callable[[], np.random.Generator]
) -> list[int]:
    """Sample ``max(minimum, int(fraction * len(keys)))`` keys without replacement (sorted).
    ``rng``: the generator, or a function making it, called only when a draw is needed (a sample of
    every key is all of them: making a generator costs more than a small round's other sampling)."""
    keys = sorted(keys)
    k = min(len(keys), max(int(minimum), int(fraction * len(keys))))
    if k == len(keys) or not k:  # (no draw: all of them, or none)
        return keys if k else []
    if callable(rng):
        rng = rng()
    return sorted(rng.choice(keys, size=k, replace=False).tolist())


def level_for_budget(budget: float, level_costs: Sequence[float]) -> int | None:
    """Index of the largest level whose cost fits the budget (levels listed largest first)."""
    for index, cost in enumerate(level_costs):
        if cost <= budget:
            return index
    return None


def level_index_of(level: float, levels: Sequence[float], tol: float = 1e-9) -> int | None:
    """Index of a declared level value in the configured levels, or None."""
    for index, value in enumerate(levels):
        if abs(float(value) - float(level)) <= tol:
            return index
    return None


def describe_assignment(assignment: Mapping[int, int], levels: Sequence[float]) -> dict[str, int]:
    """How many clients have each level (for logs and outputs)."""
    counts = {f"{float(v):g}": 0 for v in levels}
    for index in assignment.values():
        counts[f"{float(levels[index]):g}"] += 1
    return counts
