"""The nodes the server knows: each one's node info, its stable key and how outputs name it.

One job: who is known and by what name and key. A node's key is its partition id when no other node
claims the same one, else a stable hash of its ``node-name`` (or node id); keys order nodes, seed
their draws and sample them. The connected nodes not asked for their node info yet
(``availability.query = sampled``) are held here too, by node id, until a round asks them. Learning
who is connected and asking them is :mod:`~fedhm_flwr.server.nodes`' job.
"""

from __future__ import annotations

import functools
import hashlib
from logging import INFO, WARNING

from flwr.supercore import log

from fedhm_flwr.core.protocol import NodeInfo

#: keys of nodes without a unique partition id start here (partition ids stay below)
_HASHED_KEY_BASE = 1 << 40


@functools.lru_cache(maxsize=1 << 17)  # each node's key hashed once, not at every draw (bounded)
def hashed_key(identity: str) -> int:
    """A stable integer key for an identity string (above every partition id)."""
    return _HASHED_KEY_BASE + int(hashlib.sha256(identity.encode()).hexdigest()[:12], 16)


class KnownNodes:
    """Connected nodes with their cached node info, stable keys and labels."""

    def __init__(self) -> None:
        self.nodes: dict[int, NodeInfo] = {}
        self.keys: dict[int, int] = {}  # node id -> stable key (sorting, seeds, sampling)
        self.unknown: list[int] = []  # connected nodes not queried yet (availability.query = sampled)
        self._former: dict[int, str] = {}  # node id -> label of a node that left (its failures keep its name)

    def rekey(self) -> None:
        """Node -> key: its partition id when no other node claims the same one, else a stable
        hash of its name (or node id)."""
        owners: dict[int, list[int]] = {}
        for n, info in sorted(self.nodes.items()):
            if info.partition_id is not None:
                owners.setdefault(info.partition_id, []).append(n)
        shared = {pid: ns for pid, ns in owners.items() if len(ns) > 1}
        if shared:
            log(
                WARNING,
                "nodes %s declare the same partition-id; each node config needs its own "
                "(they still train, keyed by name or node id)",
                shared,
            )
        self.keys = {}
        for n, info in self.nodes.items():
            if info.partition_id is not None and info.partition_id not in shared:
                self.keys[n] = info.partition_id
            else:
                self.keys[n] = hashed_key(f"name:{info.name}" if info.name else f"node:{n}")

    def key(self, node_id: int) -> int:
        return self.keys[node_id]

    def label(self, node_id: int) -> str:
        """How outputs name a node: ``p<partition id>``, else its node-name, else ``n<node id>``."""
        info = self.nodes.get(node_id)
        if info is None:
            return self._former.get(node_id, f"n{node_id}")
        if self.keys.get(node_id) == info.partition_id and info.partition_id is not None:
            return f"p{info.partition_id}"
        return info.name or f"n{node_id}"

    def by_key(self, node_ids: list[int]) -> list[int]:
        return sorted(node_ids, key=self.key)

    def forget(self, node_id: int, server_round: int, why: str = "") -> None:
        """A node left (no longer connected, or the SuperLink answered for it: node unavailable):
        log it and forget it; if it reconnects it is asked again and logged as back."""
        if node_id not in self.nodes:
            return
        self._former[node_id] = self.label(node_id)
        log(
            INFO,
            "round %d: node %s (node id %d) left%s",
            server_round,
            self.label(node_id),
            node_id,
            f" ({why})" if why else "",
        )
        del self.nodes[node_id]
        self.keys.pop(node_id, None)
