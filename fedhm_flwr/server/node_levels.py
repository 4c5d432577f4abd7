"""A node's level: for the run, decided when the node joins from its node info alone
(:class:`LevelAssignment`, which also keeps, for checkpoints, the level each identity had), and each
round's (drawn per round with ``levels.assignment = dynamic``).

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
from typing import Any, cast

from flwr.supercore import log

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core.protocol import CAPABILITY_BUDGETS, CAPABILITY_LEVEL, NodeInfo
from fedhm_flwr.math import levels as lv
from fedhm_flwr.server.known_nodes import KnownNodes

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


class LevelAssignment:
    """Each node's level: fixed for the run when it joins, drawn per round when dynamic."""

    def __init__(
        self, opts: RunOptions, levels: list[float], costs: Sequence[Mapping[str, float]], known: KnownNodes
    ) -> None:
        self.opts, self.levels, self.known = opts, levels, known
        self.costs = costs  # level index -> its costs (what a declared budget is compared with)
        self.levels_of: dict[int, int] = {}  # node id -> level index for the run (fixed/declared)
        self.declared: dict[int, int] = {}  # node id -> level the node itself declared (or the default)
        self.seen: dict[str, int] = {}  # identity -> level index it had (survives leaving)
        self.fixed = opts.levels.assignment == "fixed"
        self.seed, self.proportions = opts.seed, opts.levels.shares

    def settle(self, server_round: int, new: list[int]) -> None:
        """Fix the level of each of these newly answered nodes for the run; log the ones that joined
        (and each returning node's)."""
        joined = [n for n in new if self._settle(n, server_round)]
        log_joined(server_round, joined, lambda n: self.levels[self.levels_of[n]], self._joined_line)

    def _settle(self, node_id: int, server_round: int) -> bool:
        """Fix a newly connected node's level for the run (and log a returning node's); True when
        the node is new to the run."""
        info, label = self.known.nodes[node_id], self.known.label
        index = declared_level(info, self.levels, self.costs, label(node_id))
        if index is not None:
            self.declared[node_id] = index
        elif self.opts.levels.default is not None:
            # the config check admits only a default among levels.ratios: it has an index
            index = cast(int, lv.level_index_of(self.opts.levels.default, self.levels))
            self.declared[node_id] = index
        else:
            index = stable_level(info, self.known.key(node_id), self.proportions, self.seed, self.opts.num_clients)
        self.levels_of[node_id] = index
        identity = info.identity()
        before = self.seen.get(identity)
        if before is not None:
            log(
                INFO,
                "round %d: node %s is back (node id %d) -> level %g (was %g)",
                server_round,
                label(node_id),
                node_id,
                self.levels[index],
                self.levels[before],
            )
        self.seen[identity] = index
        return before is None

    def _joined_line(self, node_id: int) -> str:
        examples = self.known.nodes[node_id].examples
        level = self.levels[self.levels_of[node_id]]
        return f"{self.known.label(node_id)} joined (node id {node_id}) -> level {level:g}" + (
            "" if examples is None else f", {examples} training examples"
        )

    def assign(self, server_round: int, node_ids: list[int]) -> dict[int, int]:
        """Level index of each sampled node this round (fixed: the node's own; dynamic: drawn)."""
        if self.fixed:
            return {n: self.levels_of[n] for n in node_ids}
        rng = lv.round_rng(self.seed, server_round, stream=1)
        drawn = lv.dynamic_levels(len(node_ids), self.proportions, rng)
        out = dict(zip(node_ids, drawn))
        out.update({n: self.declared[n] for n in node_ids if n in self.declared})
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the level each identity had."""
        return {"levels_by_identity": dict(self.seen)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.seen = {str(k): int(v) for k, v in state.get("levels_by_identity", {}).items()}
