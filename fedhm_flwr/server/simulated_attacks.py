"""The attacks the round asks nodes to simulate (``failures.attack``: which nodes attack and what
their task config adds) and the seeded failure injection (``failures.*_probability``: which nodes
crash or dawdle). What a malicious client then does is :mod:`fedhm_flwr.math.attacks` (its update)
and :mod:`fedhm_flwr.client.hostile` (malformed replies); the defences against it are
:mod:`fedhm_flwr.server.untrusted`. Attackers are a seeded, fixed set for the run: a node with a
partition id is one of ``round(fraction · partitions)`` drawn partitions, any other node is drawn
by a seeded hash of its identity.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache
from typing import Any

import numpy as np

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core import protocol as wire
from fedhm_flwr.math import levels as lv

#: random-stream id of the attackers' draw (levels.round_rng uses 0-3 elsewhere)
ATTACK_STREAM = 4451


@lru_cache(maxsize=64)
def attacker_partitions(num_partitions: int, fraction: float, seed: int) -> frozenset[int]:
    """The malicious partitions of a run: ``round(fraction · num_partitions)`` of them, drawn by a
    seeded permutation (a constant of the run, whoever is connected)."""
    count = int(math.floor(fraction * num_partitions + 0.5))
    order = np.random.default_rng([int(seed), ATTACK_STREAM]).permutation(int(num_partitions))
    return frozenset(int(p) for p in order[:count])


def hashed_attacker(identity: str, fraction: float, seed: int) -> bool:
    """A node known only by a name is malicious with probability ``fraction`` (seeded hash)."""
    digest = hashlib.sha256(f"{int(seed)}:attack:{identity}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


class Attacks:
    """Which nodes attack (``failures.attack``) and what their task config adds; which nodes the
    seeded failure injection makes crash or dawdle (``failures.*_probability``)."""

    def __init__(self, opts: RunOptions) -> None:
        self.failures = opts.failures
        self.attack = opts.failures.attack
        self.seed = opts.seed
        self._no_attack = self.attack.kind == "none" or self.attack.fraction <= 0
        self._attack_kind = self.attack.kind
        self._no_failures = not (self.failures.crash_probability or self.failures.slow_probability)
        self.columns: dict[str, Any] = {}

    def is_attacker(self, info: Any, key: int, node_id: int) -> bool:
        """``info``: the node's :class:`fedhm_flwr.core.protocol.NodeInfo` (None: unknown); ``key``: its stable key."""
        if self._no_attack:
            return False
        fraction = self.attack.fraction
        if info is not None and info.partition_id is not None and info.num_partitions and key == info.partition_id:
            return info.partition_id in attacker_partitions(int(info.num_partitions), fraction, self.seed)
        return hashed_attacker(info.identity() if info is not None else f"node:{node_id}", fraction, self.seed)

    def begin_round(self, attackers: list[str]) -> None:
        """The round's columns: the sampled nodes that attack (their labels, in key order)."""
        self.columns = {}
        if self._attack_kind != "none":
            self.columns.update({"attackers": json.dumps(attackers), "attackers_count": len(attackers)})

    def train_config(self) -> dict[str, Any]:
        """What the server adds to a malicious node's train config."""
        out: dict[str, Any] = {wire.ATTACK: self.attack.kind, wire.ATTACK_SCALE: self.attack.scale}
        if self._attack_kind == "malformed":
            out[wire.ATTACK_MALFORMED] = self.attack.malformed
        return out

    def injected_failures(self, server_round: int, node_ids: list[int]) -> dict[int, str]:
        """Seeded failure injection (``failures.*``): node -> 'crash' or 'slow' for this round
        (``node_ids`` in key order)."""
        fail = self.failures
        if self._no_failures:
            return {}
        rng = lv.round_rng(self.seed, server_round, stream=2)
        out = {}
        for node_id in node_ids:
            crash, slow = rng.random(), rng.random()
            if crash < fail.crash_probability:
                out[node_id] = "crash"
            elif slow < fail.slow_probability:
                out[node_id] = "slow"
        return out
