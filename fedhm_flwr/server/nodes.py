"""Node discovery: who is connected, and what each new node declares (its node-info answer).

One job: learn the nodes. Each round it forgets the nodes gone and asks the new ones for their node
config once (``node-info`` query, carrying the run's data spec: the node answers with its number of
training examples), when the node is new or reconnects, and caches the answer
(:class:`~fedhm_flwr.server.known_nodes.KnownNodes`): all new nodes in one push and one pull loop;
a node answering with an error sits out until it reconnects. The start-up before round 1
(:meth:`NodeDiscovery.startup`) asks the nodes round 1 will use, so that no round pays for the
first contact (under the simulation engine, the workers' start). With ``availability.query =
sampled`` a new node is asked only when a round first samples it (a node not yet asked is sampled by
a hash of its node id, then by its stable key: :mod:`~fedhm_flwr.server.sampling`): no round pays
for nodes that are not in it, at the price of a first-contact sample that follows node ids (which
the simulation engine draws anew). A new node's level is settled as it answers
(:class:`~fedhm_flwr.server.node_levels.LevelAssignment`). What the queries took is counted per round
(``query_seconds``, ``queried``, ``excluded``: the round's row).
"""

from __future__ import annotations

import json
import math
import time
from logging import INFO, WARNING
from typing import Any

from flwr.serverapp import Grid
from flwr.supercore import log

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core import protocol
from fedhm_flwr.server.ahead import AheadQueries
from fedhm_flwr.server.known_nodes import KnownNodes
from fedhm_flwr.server.node_levels import LevelAssignment
from fedhm_flwr.server.sampling import RoundSampler
from fedhm_flwr.server.transport import (
    NODE_UNAVAILABLE,
    collect,
    content_bytes,
    node_info_queries,
    parse_node_info,
    push,
)


class NodeDiscovery:
    """Connected nodes learnt and asked for their node info (see the module docstring)."""

    def __init__(self, opts: RunOptions, known: KnownNodes, levels: LevelAssignment, sampler: RoundSampler) -> None:
        self.opts, self.known, self.levels, self.sampler = opts, known, levels, sampler
        #: connected nodes that sit out (their node-info answer was an error, e.g. a broken shard) ->
        #: why; asked again only once they were seen gone and reconnect
        self.excluded: dict[int, str] = {}
        self.silent: set[int] = set()  # nodes that left a node-info query unanswered (then waited for briefly)
        self.query_seconds = 0.0  # this round's wall time in node-info queries
        self.queried = 0  # nodes asked this round
        self._waited_for: int | None = None  # the round the start-up waited for nodes for
        self.data_spec = json.dumps(opts.data_spec())  # each node reports its example count for it
        self.ahead = AheadQueries(self.data_spec)  # node-info queries asked ahead (start-up, prefetch)
        self.marks: dict[str, float] = {}  # the first node-info answers' start-up marks (#53, reporting/startup.py)
        self.ask_when_sampled = opts.availability.query == "sampled"
        self.min_nodes = opts.availability.min_nodes or opts.min_train_nodes

    def refresh(self, grid: Grid, server_round: int) -> int:
        """Learn the connected nodes: forget the ones gone, query the new ones (``availability.query
        = all``) or leave them for the round that samples them (``sampled``); returns the bytes the
        queries and their answers moved."""
        self.query_seconds, self.queried, self.ahead.seconds = self.ahead.seconds, 0, 0.0
        if server_round != self._waited_for:  # the start-up waited for its first round already
            connected = self.wait_for_nodes(grid, server_round)
        else:
            connected = set(grid.get_node_ids())
        known = self.known
        for node_id in sorted(set(known.nodes) - connected):
            known.forget(node_id, server_round)
        for node_id in sorted(set(self.excluded) - connected):  # asked again when it reconnects
            log(INFO, "round %d: node %d, which sat out, left", server_round, node_id)
            del self.excluded[node_id]
        new = sorted(connected - set(known.nodes) - set(self.excluded))
        if self.ask_when_sampled:
            known.unknown = new
            return 0
        known.unknown = []
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
            self.known.nodes[node_id] = info
        asked = set(new)
        self.known.unknown = [n for n in self.known.unknown if n not in asked]
        self.known.rekey()
        self.levels.settle(server_round, [n for n in new if n in self.known.nodes])
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
        told = [*self.known.nodes.values(), *(parse_node_info(n, m) for n, m in self.ahead.answers.items())]
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
        ask = [n for n in node_ids if n not in self.known.nodes]
        moved = self.query(grid, server_round, ask) if ask else 0
        moved += self.ahead.clear()  # what was asked ahead for a sample that did not come stays unread
        return [n for n in node_ids if n in self.known.nodes], moved

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
        nodes = self.known.nodes  # the sample as refresh will see them:
        staying, unknown = [n for n in nodes if n in connected], sorted(connected - set(nodes))
        picked = self.sampler.sample(next_round, staying, unknown)
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
