"""The node registry: who is connected, what each node declared, and its level for the run (decided
from the node alone: :mod:`fedhm_flwr.server.node_levels`).

The registry queries a node's node config once (``node-info`` query, carrying the run's data
spec: the node answers with its number of training examples), when the node is new or
reconnects, and caches it: all new nodes in one push and one pull loop. The start-up before round
1 (:meth:`NodeRegistry.startup`) asks the nodes round 1 will use, so that no round pays for the
first contact (under the simulation engine, the workers' start). With ``availability.query =
sampled`` a new node is asked only when a round first samples it (a node not yet asked is sampled by
a hash of its node id, then by its stable key): no round pays for nodes that are not in it, at the
price of a first-contact sample that follows node ids (which the simulation engine draws anew).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, cast

from flwr.serverapp import Grid
from flwr.supercore import log

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core import protocol
from fedhm_flwr.core.protocol import NodeInfo as NodeInfo  # re-exported for the strategy
from fedhm_flwr.math import levels as lv
from fedhm_flwr.server.ahead import AheadQueries
from fedhm_flwr.server.node_levels import PoissonDraws, declared_level, log_joined, stable_level
from fedhm_flwr.server.transport import (
    NODE_UNAVAILABLE,
    collect,
    content_bytes,
    node_info_queries,
    parse_node_info,
    push,
)

#: keys of nodes without a unique partition id start here (partition ids stay below)
_HASHED_KEY_BASE = 1 << 40


@functools.lru_cache(maxsize=1 << 17)  # each node's key hashed once, not at every draw (bounded)
def hashed_key(identity: str) -> int:
    """A stable integer key for an identity string (above every partition id)."""
    return _HASHED_KEY_BASE + int(hashlib.sha256(identity.encode()).hexdigest()[:12], 16)


class NodeRegistry:
    """Connected nodes, their cached node info, stable keys and levels."""

    def __init__(self, opts: RunOptions, levels: list[float], costs: Sequence[Mapping[str, float]]) -> None:
        self.opts = opts
        self.levels = levels
        self.costs = costs  # level index -> its costs (what a declared budget is compared with)
        self.nodes: dict[int, NodeInfo] = {}
        self.keys: dict[int, int] = {}  # node id -> stable key (sorting, seeds, sampling)
        self.levels_of: dict[int, int] = {}  # node id -> level index for the run (fixed/declared)
        self.declared: dict[int, int] = {}  # node id -> level the node itself declared (or the default)
        self.seen: dict[str, int] = {}  # identity -> level index it had (survives leaving)
        self.unknown: list[int] = []  # connected nodes not queried yet (availability.query = sampled)
        #: connected nodes that sit out (their node-info answer was an error, e.g. a broken shard) ->
        #: why; asked again only once they were seen gone and reconnect
        self.excluded: dict[int, str] = {}
        self.silent: set[int] = set()  # nodes that left a node-info query unanswered (then waited for briefly)
        self._former: dict[int, str] = {}  # node id -> label of a node that left (its failures keep its name)
        self.query_seconds = 0.0  # this round's wall time in node-info queries
        self.queried = 0  # nodes asked this round
        self._waited_for: int | None = None  # the round the start-up waited for nodes for
        self.data_spec = json.dumps(opts.data_spec())  # each node reports its example count for it
        self.ahead = AheadQueries(self.data_spec)  # node-info queries asked ahead (start-up, prefetch)
        self.marks: dict[str, float] = {}  # the first node-info answers' start-up marks (#53, reporting/startup.py)
        # the round's rules, read once (a config lookup costs more than a round's sampling at 10 nodes)
        self.ask_when_sampled = opts.availability.query == "sampled"
        self.fixed_levels = opts.levels.assignment == "fixed"
        self.seed, self.dp = opts.seed, opts.dp.enabled
        self.fraction, self.min_train = opts.fraction_train, opts.min_train_nodes
        self.min_nodes = opts.availability.min_nodes or self.min_train
        self.proportions = opts.levels.shares
        self.poisson = PoissonDraws(self.fraction, opts.dp.seed)  # DP: the round's sample

    # ------------------------------------------------------------------ discovery

    def refresh(self, grid: Grid, server_round: int) -> int:
        """Learn the connected nodes: forget the ones gone, query the new ones (``availability.query
        = all``) or leave them for the round that samples them (``sampled``); returns the bytes the
        queries and their answers moved."""
        self.query_seconds, self.queried, self.ahead.seconds = self.ahead.seconds, 0, 0.0
        if server_round != self._waited_for:  # the start-up waited for its first round already
            connected = self.wait_for_nodes(grid, server_round)
        else:
            connected = set(grid.get_node_ids())
        for node_id in sorted(set(self.nodes) - connected):
            self.forget(node_id, server_round)
        for node_id in sorted(set(self.excluded) - connected):  # asked again when it reconnects
            log(INFO, "round %d: node %d, which sat out, left", server_round, node_id)
            del self.excluded[node_id]
        new = sorted(connected - set(self.nodes) - set(self.excluded))
        if self.ask_when_sampled:
            self.unknown = new
            return 0
        self.unknown = []
        return self.query(grid, server_round, new)

    def query(self, grid: Grid, server_round: int, new: list[int]) -> int:
        """Ask these nodes for their node info: one push of all the queries not pushed ahead, one
        pull loop (:func:`collect`; up to ``stragglers.min_seconds`` only when every node asked let an
        earlier query go unanswered); cache the answers, key and settle the nodes; returns the bytes moved."""
        if not new:
            return 0
        t0 = time.perf_counter()
        answers, ahead, counted = self.ahead.pop(new)  # asked ahead: answered already, or still out
        query = node_info_queries([n for n in new if n not in ahead and n not in answers], self.data_spec)
        counted += len(query)
        moved = sum(content_bytes(msg.content) for msg in query)
        pushed = push(grid, query)
        if pushed or ahead:
            by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in query if m.metadata.message_id}
            by_id.update({mid: n for n, mid in ahead.items()})
            brief = self.opts.stragglers.min_seconds if set(new) <= self.silent else math.inf
            wait = min(self.opts.timeout, brief)
            arrived: dict[str, float] = {}
            pulled_at = time.time()  # (#53: the first answers' start-up marks)
            came = {
                by_id[m.metadata.reply_to_message_id]: m
                for m in collect(grid, pushed + list(ahead.values()), wait, arrivals=arrived)
                if m.metadata.reply_to_message_id in by_id
            }
            told = [m.content for m in came.values() if m.has_content()]
            self.marks = protocol.first_marks(told, self.marks, pulled_at + min(arrived.values(), default=math.inf))
            moved += sum(content_bytes(m.content) for m in came.values() if m.has_content())
            answers.update(came)
        for node_id in new:
            info = parse_node_info(node_id, answers.get(node_id))
            if info.error == NODE_UNAVAILABLE or node_id not in answers:
                log(
                    WARNING,
                    "round %d: node %d did not answer its node-info query (%s)",
                    server_round,
                    node_id,
                    info.error,
                )
                self.silent.add(node_id)  # asked again (briefly) at the next round that finds it connected
                continue
            self.silent.discard(node_id)
            if info.error is not None:
                self.excluded[node_id] = info.error
                log(
                    WARNING,
                    "round %d: node %d cannot take part and sits out until it reconnects: %s",
                    server_round,
                    node_id,
                    info.error,
                )
                continue
            self.nodes[node_id] = info
        asked = set(new)
        self.unknown = [n for n in self.unknown if n not in asked]
        self._rekey()
        joined = [n for n in new if n in self.nodes and self._settle(n, server_round)]
        log_joined(server_round, joined, lambda n: self.levels[self.levels_of[n]], self._joined_line)
        self.query_seconds += time.perf_counter() - t0
        self.queried += counted
        return moved

    def startup(self, grid: Grid, server_round: int) -> dict[str, Any]:
        """Before the first round's clock starts: wait for the nodes, then learn the ones that round
        will use: every connected node (``availability.query = all``), or the round's sample, asked
        ahead and answered now but read only when the round samples (``sampled``, as
        :meth:`prefetch`). What it took is the run's start-up (the simulation engine's workers start
        on their first message and nodes find their data), not a round's; returns
        ``{"startup_seconds", "startup_queried", "startup_bytes"}``."""
        t0 = time.perf_counter()
        moved = self.refresh(grid, server_round)
        self._waited_for = server_round
        queried = self.queried
        self.prefetch(grid, server_round)
        asked, ahead_bytes = self.ahead.pull_all(grid, self.opts.timeout)
        queried, moved = queried + asked, moved + ahead_bytes
        self.query_seconds, self.queried = 0.0, 0
        seconds = time.perf_counter() - t0
        told = [*self.nodes.values(), *(parse_node_info(n, m) for n, m in self.ahead.answers.items())]
        examples = sorted(info.examples for info in told if info.examples is not None)
        log(
            INFO,
            "start-up: %d node(s) connected, %d asked for their node info in %.1fs%s",
            len(list(grid.get_node_ids())),
            queried,
            seconds,
            f"; training examples per node {examples[0]}..{examples[-1]}" if examples else "",
        )
        return {"startup_seconds": seconds, "startup_queried": queried, "startup_bytes": moved}

    def query_sampled(self, grid: Grid, server_round: int, node_ids: list[int]) -> tuple[list[int], int]:
        """(the sampled nodes that can train, bytes moved): with ``availability.query = sampled``
        the sampled nodes not yet known are asked now, all at once; a node whose answer is an error
        sits the round out."""
        ask = [n for n in node_ids if n not in self.nodes]
        moved = self.query(grid, server_round, ask) if ask else 0
        moved += self.ahead.clear()  # what was asked ahead for a sample that did not come stays unread
        return [n for n in node_ids if n in self.nodes], moved

    def prefetch(self, grid: Grid, next_round: int) -> None:
        """``availability.query = sampled``: push now the node-info queries of the next round's new
        nodes, so that they are answered behind this round's training (``start()`` pushes them right
        after the round's training messages and pulls their answers along with its replies:
        :mod:`fedhm_flwr.server.ahead`). That round's sample is
        drawn here as the round will draw it (the same knowledge, if no node comes or goes in
        between); the answers are read, and the nodes learnt, only after it sampled
        (:meth:`query_sampled`), so the sample never depends on them."""
        if not self.ask_when_sampled:
            return
        t0 = time.perf_counter()
        connected = set(grid.get_node_ids())
        nodes, unknown = self.nodes, self.unknown
        self.nodes = {n: info for n, info in nodes.items() if n in connected}  # as refresh will see them
        self.unknown = sorted(connected - set(nodes))
        try:
            picked = self.sample(next_round)
        finally:
            self.nodes, self.unknown = nodes, unknown
        self.ahead.push(grid, [n for n in picked if n not in nodes])
        self.ahead.seconds += time.perf_counter() - t0

    def wait_for_nodes(self, grid: Grid, server_round: int) -> set[int]:
        """Wait (bounded) until ``availability.min_nodes`` nodes are connected (not counting those
        that sit out); then go on with the nodes present or stop, as ``availability.on_timeout`` says.
        Returns the connected nodes it saw last (one ``get_node_ids`` when enough are there: with
        many nodes each call lists them all)."""
        minimum = self.min_nodes
        connected = set(grid.get_node_ids())
        count = len(connected - set(self.excluded))  # not those sitting out
        if count >= minimum:
            return connected
        avail = self.opts.availability
        log(
            INFO,
            "round %d: %d node(s) connected, waiting up to %gs for at least %d",
            server_round,
            count,
            float(avail.wait_seconds),
            minimum,
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < float(avail.wait_seconds):
            time.sleep(min(1.0, float(avail.poll_seconds)))
            connected = set(grid.get_node_ids())
            count = len(connected - set(self.excluded))
            if count >= minimum:
                log(
                    INFO,
                    "round %d: %d node(s) connected after %.1fs; going on",
                    server_round,
                    count,
                    time.monotonic() - t0,
                )
                return connected
        if avail.on_timeout == "stop":
            raise RuntimeError(
                f"round {server_round}: only {count} of the {minimum} nodes needed "
                f"(availability.min_nodes) connected within {float(avail.wait_seconds):g}s "
                "(availability.wait_seconds); stopping as availability.on_timeout=stop says"
            )
        log(
            WARNING,
            "round %d: still %d node(s) of %d after %gs; going on with the nodes present",
            server_round,
            count,
            minimum,
            float(avail.wait_seconds),
        )
        return connected

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

    # ------------------------------------------------------------------ keys and labels

    def _rekey(self) -> None:
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

    # ------------------------------------------------------------------ levels

    def _settle(self, node_id: int, server_round: int) -> bool:
        """Fix a newly connected node's level for the run (and log a returning node's); True when
        the node is new to the run."""
        info = self.nodes[node_id]
        index = declared_level(info, self.levels, self.costs, self.label(node_id))
        if index is not None:
            self.declared[node_id] = index
        elif self.opts.levels.default is not None:
            # the config check admits only a default among levels.ratios: it has an index
            index = cast(int, lv.level_index_of(self.opts.levels.default, self.levels))
            self.declared[node_id] = index
        else:
            index = stable_level(info, self.keys[node_id], self.proportions, self.seed, self.opts.num_clients)
        self.levels_of[node_id] = index
        identity = info.identity()
        before = self.seen.get(identity)
        if before is not None:
            log(
                INFO,
                "round %d: node %s is back (node id %d) -> level %g (was %g)",
                server_round,
                self.label(node_id),
                node_id,
                self.levels[index],
                self.levels[before],
            )
        self.seen[identity] = index
        return before is None

    def _joined_line(self, node_id: int) -> str:
        examples = self.nodes[node_id].examples
        return f"{self.label(node_id)} joined (node id {node_id}) -> level {self.levels[self.levels_of[node_id]]:g}" + (
            "" if examples is None else f", {examples} training examples"
        )

    def assign(self, server_round: int, node_ids: list[int]) -> dict[int, int]:
        """Level index of each sampled node this round (fixed: the node's own; dynamic: drawn)."""
        if self.fixed_levels:
            return {n: self.levels_of[n] for n in node_ids}
        rng = lv.round_rng(self.seed, server_round, stream=1)
        drawn = lv.dynamic_levels(len(node_ids), self.proportions, rng)
        out = dict(zip(node_ids, drawn))
        out.update({n: self.declared[n] for n in node_ids if n in self.declared})
        return out

    def sample(self, server_round: int) -> list[int]:
        """The nodes that train this round (seeded by round, over the stable keys; a node not yet
        queried (``availability.query = sampled``) takes part by a hash of its node id)."""
        keys = {self.key(n): n for n in self.nodes}
        keys.update({hashed_key(f"node:{n}"): n for n in self.unknown})
        if self.dp:  # the accountant's Poisson sampling, from a stream no client knows
            return [keys[k] for k in self.poisson.sample(server_round, list(keys))]
        picked = lv.sample_clients(
            list(keys), self.fraction, self.min_train, lambda: lv.round_rng(self.seed, server_round, stream=0)
        )
        return [keys[k] for k in picked]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the level each identity had."""
        return {"levels_by_identity": dict(self.seen)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.seen = {str(k): int(v) for k, v in state.get("levels_by_identity", {}).items()}
