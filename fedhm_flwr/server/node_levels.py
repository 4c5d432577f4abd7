"""A node's level for the run, and a DP round's Poisson sample: what the node registry
(:class:`fedhm_flwr.server.nodes.NodeRegistry`) decides about a node from its node info.

A node's level depends only on that node (issue "levels that stay put"):

1. the capability it declares in its node config (``capability-level``, or a ``capability-params``
   / ``-macs`` / ``-memory`` budget mapped to the largest level that fits, :func:`declared_level`), else
2. ``levels.default`` when set, else
3. a stable function of its identity for the configured proportions (:func:`stable_level`): its
   partition id (a simulated node's, or the one recorded in its data shard's manifest) indexes a
   seeded pool of ``num_partitions`` levels; a node known only by its ``node-name`` (or, failing
   that, its node id) draws its level from a seeded hash of that name.

Never from how many nodes are connected or in what order they arrived: a node that leaves and
comes back keeps its level. Flower keeps a SuperNode's node id across restarts only with SuperNode
authentication: the level never depends on the id when a partition id or a ``node-name`` is known.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING

from flwr.supercore import log

from fedhm_flwr.core.protocol import CAPABILITY_BUDGETS, CAPABILITY_LEVEL, NodeInfo
from fedhm_flwr.math import levels as lv
from fedhm_flwr.math.privacy import poisson_sample, secret_uniform

#: more nodes than this joining at once are logged as one line (level counts), not one line each
_JOIN_LINES = 10


def stable_level(info: NodeInfo, key: int, proportions: list[float], seed: int, num_clients: int) -> int:
    """The level index of a node that declares none, from its identity (``key``: its stable key)."""
    if info.partition_id is not None and key == info.partition_id:
        total = int(info.num_partitions or num_clients)
        if 0 <= info.partition_id < total:
            return lv.partition_level(info.partition_id, total, proportions, seed)
    if info.name is None:
        log(
            WARNING,
            "node %d has neither a partition-id nor a node-name; its level follows its node id, "
            "which survives a restart only with SuperNode authentication",
            info.node_id,
        )
    return lv.hashed_level(info.identity() if info.name else f"node:{info.node_id}", proportions, seed)


def declared_level(info: NodeInfo, levels: list[float], costs: Sequence[Mapping[str, float]], label: str) -> int | None:
    """The level index a node's declared capability gives (``costs``: each level's, what a budget is
    compared with); None when it declares none (or a level not among ``levels``)."""
    cap = info.capability
    if CAPABILITY_LEVEL in cap:
        index = lv.level_index_of(cap[CAPABILITY_LEVEL], levels)
        if index is None:
            log(WARNING, "node %s declares level %s, not among %s; ignored", label, cap[CAPABILITY_LEVEL], levels)
        return index
    for budget in CAPABILITY_BUDGETS:
        if budget in cap:
            index = lv.level_for_budget(cap[budget], [costs[i].get(budget, math.inf) for i in range(len(levels))])
            if index is None:
                index = len(levels) - 1
                log(WARNING, "node %s: %s budget %g fits no level; it gets the smallest", label, budget, cap[budget])
            log(INFO, "node %s: %s budget %g -> level %g", label, budget, cap[budget], levels[index])
            return index
    return None


def log_joined(
    server_round: int, joined: list[int], level_of: Callable[[int], float], line: Callable[[int], str]
) -> None:
    """One line per node that joined (``line``: what it says of the node), or one line of level
    counts when many joined at once (``level_of``: a node's level)."""
    if len(joined) > _JOIN_LINES:
        counts: dict[float, int] = {}
        for node_id in joined:
            level = level_of(node_id)
            counts[level] = counts.get(level, 0) + 1
        log(
            INFO,
            "round %d: %d nodes joined -> %s",
            server_round,
            len(joined),
            ", ".join(f"level {level:g}: {n}" for level, n in sorted(counts.items(), reverse=True)),
        )
        return
    for node_id in joined:
        log(INFO, "round %d: node %s", server_round, line(node_id))


class PoissonDraws:
    """DP runs: each key in with probability ``fraction`` (no minimum), drawn once per round and key
    (:func:`fedhm_flwr.math.privacy.secret_uniform`; kept, so that the prefetch and the round see the
    same draw)."""

    def __init__(self, fraction: float, seed: int | None) -> None:
        self.fraction, self.seed = fraction, seed
        self._draws: dict[int, dict[int, float]] = {}  # round -> key -> its secret uniform draw

    def sample(self, server_round: int, keys: list[int]) -> list[int]:
        for old in [r for r in self._draws if r < server_round - 1]:
            del self._draws[old]
        mine = self._draws.setdefault(server_round, {})
        uniform = secret_uniform(self.seed, server_round)
        return poisson_sample(keys, self.fraction, lambda k: mine[k] if k in mine else mine.setdefault(k, uniform(k)))
