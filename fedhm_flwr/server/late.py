"""Nodes a round recorded late, kept until they answer or the SuperLink judges them (plain data, no Flower).

A round stops waiting at its deadline (``stragglers.*``) and records the nodes that did not answer as
*late*. One of them may be gone: a SuperNode killed mid-round says no goodbye, and the SuperLink reports
its node unavailable only when its heartbeats lapse, 30-60 s later, usually after the deadline. No round
waits for that. The training messages of late nodes are kept here (:class:`PendingLate`: message id ->
the round and the node) and pulled along with every later round's replies; the SuperLink's
``NODE_UNAVAILABLE`` answer to one is the verdict on the earlier round (:class:`Lost`), whose row is
amended (:func:`amend_row`): one more failure, ``node unavailable``, no longer late. Any other answer is
a late arrival of the round that pulled it. After the last round the ServerApp waits for the verdicts
still pending (at most ``stragglers.verdict_seconds``, on devices only; docs/DEPLOY.md, "Devices come
and go").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Lost:
    """The SuperLink's verdict on a node recorded late: it was lost during ``server_round``."""

    server_round: int
    node_id: int
    why: str


@dataclass
class PendingLate:
    """The training messages of nodes recorded late, across rounds, until answered or judged."""

    messages: dict[str, tuple[int, int]] = field(default_factory=dict)  # message id -> (round, node id)

    def add(self, server_round: int, sent: Mapping[str, int]) -> None:
        """Round ``server_round`` stopped waiting for these messages (message id -> the node asked)."""
        self.messages.update({mid: (server_round, node_id) for mid, node_id in sent.items() if mid})

    def ids(self) -> list[str]:
        return list(self.messages)

    def resolve(self, message_ids: Iterable[str]) -> None:
        """These messages were answered or judged (a pulled reply is gone from the SuperLink)."""
        for mid in message_ids:
            self.messages.pop(mid, None)

    def lost(self, judged: Iterable[tuple[str, str]]) -> list[Lost]:
        """The verdicts (message id, why) on pending messages as :class:`Lost`, resolved."""
        out = [Lost(*self.messages[mid], why) for mid, why in judged if mid in self.messages]
        self.resolve(mid for mid, _ in judged)
        return out


def amend_row(row: dict[str, Any], label: str, why: str, in_round: int | None) -> None:
    """Amend a round's row (``metrics.jsonl``, as :func:`fedhm_flwr.server.report.round_row` made it) for
    a verdict: node ``label`` failed (``why``) instead of being late; ``in_round``: the round whose pull
    brought the verdict (``amended_in_round``), None for the wait after the last round
    (``amended_at_run_end``). The late keys stay only while the row still has a late node or a late
    arrival, as ``round_row`` writes them."""
    row["failures"] = int(row.get("failures", 0)) + 1
    row["failure_reasons"] = json.dumps([*json.loads(row.get("failure_reasons") or "[]"), [label, why]])
    late = list(json.loads(row.get("late_nodes") or "[]"))
    if label in late:
        late.remove(label)
    if late or row.get("late_arrivals"):
        row.update({"late": len(late), "late_nodes": json.dumps(late)})
    else:
        for key in ("late", "late_nodes", "late_arrivals"):
            row.pop(key, None)
    if in_round is None:
        row["amended_at_run_end"] = True
    else:
        row["amended_in_round"] = in_round


def verdict_line(when: str, label: str, lost: Lost) -> str:
    """The log line of a verdict (``when``: ``round 3``, or ``the run's end``)."""
    return (
        f"{when}: node {label} failed in round {lost.server_round}: {lost.why} (its SuperNode was lost); "
        f"round {lost.server_round}'s record amended"
    )
