"""Node-info queries asked ahead of the round that reads their answers (``availability.query =
sampled``, and the start-up before round 1).

A query is pushed while an earlier round trains (:meth:`AheadQueries.push`), its answer is pulled
as soon as it comes, alongside that round's training replies (:meth:`AheadQueries.take`), and kept
unread until the round that sampled the node reads it (:meth:`AheadQueries.pop`): the sample never
depends on an answer. Pulling early matters under Flower's simulation engine, whose message loop
scans every stored instruction once per node and poll: a query left in the SuperLink until the next
round makes every message of this round slower to reach its node, the more so the more nodes there
are.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

from fedhm_flwr.server.transport import collect, content_bytes, node_info_queries


class AheadQueries:
    """Queries pushed ahead (node -> message id), their answers pulled and not read yet, and what
    they moved and took before a round reads them."""

    def __init__(self, data_spec: str) -> None:
        self.data_spec = data_spec
        self.pushed: dict[int, str] = {}  # node id -> id of its query, answer not pulled yet
        self.answers: dict[int, Message] = {}  # node id -> its answer, pulled and not read yet
        self.counted: set[int] = set()  # answers a start-up counted already (asked, bytes) as its own
        self.bytes, self.seconds = 0, 0.0  # queries and answers moved / push time, for the round that reads them

    def ids(self) -> list[str]:
        """The ids of the queries whose answers are still out (to pull alongside a round's replies)."""
        return list(self.pushed.values())

    def push(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Ask these nodes now (the ones not asked ahead yet)."""
        ask = [n for n in node_ids if n not in self.pushed and n not in self.answers]
        query = node_info_queries(ask, self.data_spec)
        if query:
            self.pushed.update({n: mid for n, mid in zip(ask, grid.push_messages(query)) if mid})
            self.bytes += sum(content_bytes(msg.content) for msg in query)

    def take(self, replies: Iterable[Message]) -> list[Message]:
        """Keep the answers to queries asked ahead among ``replies``; the other replies."""
        by_id = {mid: n for n, mid in self.pushed.items()}
        rest = []
        for msg in replies:
            node_id = by_id.get(msg.metadata.reply_to_message_id)
            if node_id is None:
                rest.append(msg)
                continue
            del self.pushed[node_id]
            self.answers[node_id] = msg
            self.bytes += content_bytes(msg.content) if msg.has_content() else 0
        return rest

    def pull_all(self, grid: Grid, timeout: float) -> tuple[int, int]:
        """The start-up: wait (up to ``timeout``) for every answer and count them as its own;
        (queries asked, bytes moved)."""
        self.take(collect(grid, self.ids(), timeout))
        asked, moved = len(self.pushed) + len(self.answers), self.bytes
        self.counted = set(self.answers)
        self.bytes, self.seconds = 0, 0.0
        return asked, moved

    def pop(self, node_ids: Iterable[int]) -> tuple[dict[int, Message], dict[int, str], int]:
        """These nodes' (answers pulled, queries still out, how many of both a round counts as
        asked): a start-up's answers count as the start-up's."""
        nodes = list(node_ids)
        answers = {n: self.answers.pop(n) for n in nodes if n in self.answers}
        pushed = {n: self.pushed.pop(n) for n in nodes if n in self.pushed}
        counted = len(pushed) + len([n for n in answers if n not in self.counted])
        return answers, pushed, counted

    def clear(self) -> int:
        """Forget what was asked for a sample that did not come (nodes came or went; unread);
        returns the bytes moved, which the round that drops them still counts."""
        moved = self.bytes
        self.pushed.clear()
        self.answers.clear()
        self.counted.clear()
        self.bytes = 0
        return moved
