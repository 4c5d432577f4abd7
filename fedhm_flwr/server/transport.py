"""The server's side of the wire (:mod:`fedhm_flwr.core.protocol` holds what both sides read): the
task-config entry of the wire dtype, the node-info queries and their answers, pushing messages and
pulling their replies until a round's deadline (:class:`Deadline`, ``stragglers``), and matching each
reply to the node that was asked (never to its sender) with why an error reply failed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.app.typing import ConfigRecordValues
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE, ErrorCode

from fedhm_flwr.core.protocol import CONFIG, DATA_SPEC, NODE_INFO, QUERY, WIRE_DTYPE, NodeInfo

# ---------------------------------------------------------------------- node info, who was asked, why one failed

#: the reason recorded for a node the SuperLink answered for: it missed its heartbeats (Flower's
#: ``NODE_UNAVAILABLE`` error reply, sent by the SuperLink itself, not by the node)
NODE_UNAVAILABLE = "node unavailable"
#: seconds after a node's last heartbeat by which the SuperLink reports it unavailable (a SuperNode's default
#: interval, Flower's patience), plus a margin: how long the run's end waits, on devices, for its verdict on
#: nodes still late after the last round (``stragglers.verdict_seconds``' default)
HEARTBEAT_VERDICT = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + 2.0
#: what a late message is mapped to (the node asked, or the message id itself)
T = TypeVar("T")


def asked_ids(messages: Sequence[Message]) -> tuple[dict[str, int], set[int]]:
    """(message id -> the node it went to, for the messages pushed; the nodes of messages never pushed,
    which have no id: a reply from such a node is taken as its answer, as when calling
    ``aggregate_train`` on replies gathered elsewhere)."""
    asked = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
    return asked, {m.metadata.dst_node_id for m in messages if not m.metadata.message_id}


def asked_nodes(messages: list[Message], replies: list[Message]) -> list[tuple[int, Message]]:
    """(the node that was asked, its reply) for each reply to these pushed ``messages``: the first
    reply to each, matched to the message it answers, never to its sender (the SuperLink answers
    itself for a node that missed its heartbeats: ``Node Unavailable``, sent from the SuperLink's own
    node id). A reply to none of the messages, or a second reply to one, is left out."""
    asked, unpushed = asked_ids(messages)
    out, seen = [], set()
    for reply in replies:
        node_id = asked.get(reply.metadata.reply_to_message_id)
        if node_id is None and reply.metadata.src_node_id in unpushed:
            node_id = reply.metadata.src_node_id
        if node_id is not None and node_id not in seen:
            seen.add(node_id)
            out.append((node_id, reply))
    return out


def error_reason(msg: Message) -> str:
    """Why an error reply failed: :data:`NODE_UNAVAILABLE` when the SuperLink says the node is
    gone, else the node's own error."""
    if msg.error.code == ErrorCode.NODE_UNAVAILABLE:
        return NODE_UNAVAILABLE
    return f"client error: {msg.error.reason}"


def parse_node_info(node_id: int, msg: Message | None) -> NodeInfo:
    """A node's NodeInfo from its ``node-info`` reply (an error reply is kept as ``error``)."""
    if msg is None:
        return NodeInfo(node_id=node_id, error="no answer to the node-info query")
    if msg.has_error():
        why = error_reason(msg)
        return NodeInfo(node_id=node_id, error=why if why == NODE_UNAVAILABLE else msg.error.reason)
    try:
        if CONFIG not in msg.content:
            return NodeInfo(node_id=node_id)
        return dataclasses.replace(NodeInfo.decode(msg.content[CONFIG]), node_id=node_id)
    except Exception as exc:  # noqa: BLE001 (a malformed answer: the node sits out, the round goes on)
        return NodeInfo(node_id=node_id, error=f"malformed node-info answer: {exc}")


def node_info_queries(node_ids: list[int], data_spec: str | None = None) -> list[Message]:
    """One ``node-info`` query per node; with the run's data spec (JSON), each node also reports
    how many training examples it holds for it (and finds its data before the first round)."""
    config: dict[str, ConfigRecordValues] = {QUERY: NODE_INFO, **({DATA_SPEC: data_spec} if data_spec else {})}
    return [
        Message(content=RecordDict({CONFIG: ConfigRecord(config)}), dst_node_id=n, message_type=MessageType.QUERY)
        for n in node_ids
    ]


# ---------------------------------------------------------------------- task configs, pushing and pulling


def content_bytes(content: RecordDict) -> int:
    """Bytes of a message's records (arrays, config and metrics alike)."""
    return sum(record.count_bytes() for record in content.values())


def wire_config(dtype: str) -> dict[str, str]:
    """The task-config entry telling a node the wire dtype (absent at the default float32)."""
    return {} if dtype == "float32" else {WIRE_DTYPE: dtype}


# ---------------------------------------------------------------------- pushing and pulling


def push(grid: Any, messages: list[Message]) -> list[str]:
    """Push ``messages`` (none: no call); the ids of those the grid took."""
    return [mid for mid in grid.push_messages(messages) if mid] if messages else []


@dataclass(frozen=True)
class Deadline:
    """When a round stops waiting for its replies (``stragglers``): at ``timeout`` seconds after the
    push at the latest; once a ``quorum`` (a fraction) of the nodes still expected to answer did,
    at ``factor`` times the median time the answers so far took (so the deadline moves on while
    answers keep coming: nodes served one after another, as a simulation's few workers serve them,
    arrive evenly and the median of those in is half the time so far), and never before ``floor``
    seconds. Error replies (a crashed node, one the SuperLink reports gone) are no answers: they
    shrink the nodes expected, they do not set the pace."""

    timeout: float
    quorum: float = 1.0
    factor: float = math.inf
    floor: float = 0.0

    def end(self, expected: int, arrivals: Sequence[float]) -> float:
        """Seconds after the push at which waiting stops: ``expected`` nodes still expected to
        answer, ``arrivals`` the seconds the answers so far took."""
        need = max(1, math.ceil(self.quorum * expected - 1e-9))
        if len(arrivals) < need or not math.isfinite(self.factor):
            return self.timeout
        pace = statistics.median(arrivals)
        return min(self.timeout, max(self.floor, self.factor * pace))


def collect(
    grid: Any,
    message_ids: list[str],
    timeout: float | Deadline,
    poll: float = 0.01,
    max_poll: float = 0.1,
    also: Sequence[str] = (),
    arrivals: dict[str, float] | None = None,
) -> list[Message]:
    """Pull the replies to these pushed messages until all came or the deadline passed (``timeout``
    seconds, or a :class:`Deadline`); the replies to ``also`` are pulled along when they came, not
    waited for. ``arrivals`` (filled when given): message id -> seconds its answer took (error
    replies left out)."""
    deadline = timeout if isinstance(timeout, Deadline) else Deadline(float(timeout))
    pending, extra = set(message_ids), set(also)
    replies: list[Message] = []
    took: dict[str, float] = {} if arrivals is None else arrivals
    errors = 0
    start = time.monotonic()
    while pending:
        got = list(grid.pull_messages(list(pending | extra)))
        now = time.monotonic() - start
        replies += got
        for msg in got:
            mid = msg.metadata.reply_to_message_id
            if mid in pending:
                pending.discard(mid)
                if msg.has_error():
                    errors += 1
                else:
                    took[mid] = now
            extra.discard(mid)
        if not pending or now >= deadline.end(len(message_ids) - errors, list(took.values())):
            break
        time.sleep(poll)
        poll = min(2 * poll, max_poll)
    return replies


def late_verdicts(late: Mapping[str, T], replies: Iterable[Message]) -> tuple[list[tuple[T, str]], list[Message]]:
    """What a new pull of ``late`` training messages (message id -> what it stands for: the node asked,
    or the message id itself) brought: (those the SuperLink now reports unavailable, each with
    :data:`NODE_UNAVAILABLE`: their SuperNode was lost; the other replies to them: answers that came after
    the deadline). A reply to none of them is left out."""
    lost: list[tuple[T, str]] = []
    answered: list[Message] = []
    for msg in replies:
        mid = msg.metadata.reply_to_message_id
        if mid not in late:
            continue
        if msg.has_error() and msg.error.code == ErrorCode.NODE_UNAVAILABLE:
            lost.append((late[mid], NODE_UNAVAILABLE))
        else:
            answered.append(msg)
    return lost, answered


def settle_late(
    grid: Any, late: Mapping[str, T], wait: float, poll: float = 1.0
) -> tuple[list[tuple[T, str]], list[Message]]:
    """Pull ``late`` training messages (message id -> what it stands for) once more and, while some are
    neither answered nor reported unavailable, again every ``poll`` s for at most ``wait`` s:
    :func:`late_verdicts` of all that came. A SuperNode killed mid-round says no goodbye; the SuperLink
    reports its node unavailable only when its heartbeats lapse (``HEARTBEAT_PATIENCE`` ×
    ``HEARTBEAT_DEFAULT_INTERVAL``, 30-60 s after the kill), often after the round's deadline."""
    pending = dict(late)
    lost: list[tuple[T, str]] = []
    answered: list[Message] = []
    end = time.monotonic() + wait
    while pending:
        got = list(grid.pull_messages(list(pending)))
        gone, came = late_verdicts(pending, got)
        lost += gone
        answered += came
        for msg in got:
            pending.pop(msg.metadata.reply_to_message_id, None)
        if not pending or time.monotonic() >= end:
            break
        time.sleep(min(poll, max(0.0, end - time.monotonic())))
    return lost, answered


def exchange(
    grid: Any, messages: list[Message], timeout: float | Deadline, poll: float = 0.01, max_poll: float = 0.1
) -> list[Message]:
    """Push all ``messages`` at once, then pull their replies until all came or the deadline passed
    (:func:`collect`). Like ``Grid.send_and_receive``, but polling from ``poll`` seconds, doubling
    up to ``max_poll`` (Flower's loop sleeps 3 s between pulls: every exchange ends up to 3 s
    after its last reply)."""
    return collect(grid, push(grid, messages), timeout, poll, max_poll)
