"""The one wire contract between the server and the nodes: record names, message keys, and the
encode/decode of what both sides must read alike (node info, training and evaluation replies).

Every message is a Flower ``RecordDict`` with at most three records: ``arrays`` (model tensors),
``config`` (what the server tells a node: task, specs, queries) and ``metrics`` (what a node
reports); a bn-stats query and its reply hold one ``arrays.<i>`` record per model instead
(:mod:`fedhm_flwr.core.bn_wire`: every level's model in one message). The server writes task configs and
reads replies; the ClientApp reads task configs and writes replies; both import the names from
here, so a key is spelled in one place.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues, MetricRecordValues
from flwr.common.constant import ErrorCode

# arrays on the wire, re-exported as part of the contract (wire.wire_array, wire.record_tensors, ...)
from fedhm_flwr.core.wire_arrays import (
    WIRE_DTYPES as WIRE_DTYPES,
    array_record as array_record,
    from_wire as from_wire,
    npy_header as npy_header,
    record_tensors as record_tensors,
    reply_tensors as reply_tensors,
    wire_array as wire_array,
)

# records
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"

# queries (config["query"] of a QUERY message)
QUERY = "query"
NODE_INFO, BN_STATS = "node-info", "bn-stats"
#: a bn-stats query carries any number of models in one message (every level's at once): their specs
#: in config[MODEL_SPECS] (a list), model i's arrays in the record ``bn_wire.bn_record(i)``; the reply
#: holds model i's sums in the record of the same name
MODEL_SPECS = "model-specs"
#: a bn-stats query: the most training examples a node sums over (a subset drawn with the query's
#: seed; absent or 0: all of them)
BN_EXAMPLES = "bn-examples"

# task config keys (server -> node)
SERVER_ROUND, METHOD, LEVEL, LEVEL_INDEX = "server-round", "method", "level", "level-index"
MODEL_SPEC, DATA_SPEC, TRAIN, SEED, BATCH_SIZE = "model-spec", "data-spec", "train", "seed", "batch-size"
WIRE_DTYPE = "wire-dtype"  # dtype of the arrays both ways (wire.dtype); absent: float32
INJECT, INJECT_SECONDS = "inject", "inject-seconds"  # failure injection (failures.*)
ATTACK, ATTACK_SCALE, ATTACK_MALFORMED = "attack", "attack-scale", "attack-malformed"  # failures.attack

# node config keys (a node's own settings) and its node-info reply
PARTITION_ID, NUM_PARTITIONS, NODE_NAME, DATA_DIR = "partition-id", "num-partitions", "node-name", "data-dir"
CAPABILITY = "capability-"  # prefix: capability-level, -params, -macs, -memory
#: what a node may declare after the prefix: its level, or a budget (a cost of methods.common.level_costs)
CAPABILITY_LEVEL, CAPABILITY_BUDGETS = "level", ("params", "macs", "memory")

# reply metric keys (node -> server)
NUM_EXAMPLES, CLASS_COUNTS, SECONDS = "num-examples", "class-counts", "seconds"
TRAIN_LOSS, TRAIN_ACCURACY = "train-loss", "train-accuracy"
EVAL_LOSS, EVAL_ACCURACY = "eval-loss", "eval-accuracy"
RAY_NODE = "ray-node"  # simulation: the first 12 hex digits of the Ray node id the client ran on, as an int


@dataclass
class NodeInfo:
    """What a node tells the server about itself (its ``node-info`` reply)."""

    partition_id: int | None = None
    num_partitions: int | None = None
    name: str | None = None
    capability: dict[str, float] = field(default_factory=dict)
    #: training examples the node holds for the data spec the query carried (None: not asked)
    examples: int | None = None
    node_id: int = 0  # the server's side: the node the answer came from (not encoded)
    error: str | None = None  # the server's side: the node's answer was an error (e.g. a broken shard)

    def identity(self) -> str:
        """What identifies the node across restarts (its name, else its partition, else its id)."""
        if self.name:
            return f"name:{self.name}"
        if self.partition_id is not None:
            return f"partition:{self.partition_id}"
        return f"node:{self.node_id}"

    def encode(self) -> ConfigRecord:
        out: dict[str, Any] = {}
        if self.partition_id is not None:
            out[PARTITION_ID] = int(self.partition_id)
        if self.num_partitions is not None:
            out[NUM_PARTITIONS] = int(self.num_partitions)
        if self.name:
            out[NODE_NAME] = str(self.name)
        if self.examples is not None:
            out[NUM_EXAMPLES] = int(self.examples)
        out.update({CAPABILITY + k: float(v) for k, v in self.capability.items()})
        return ConfigRecord(out)

    @classmethod
    def decode(cls, rec: Mapping[str, Any]) -> NodeInfo:
        """The node info :meth:`encode` wrote; ValueError naming the field when a value has another
        form (a node's answer is untrusted input: no conversion of what it sends)."""

        def whole(key: str, low: int) -> int | None:
            value = rec.get(key)
            if value is not None and (type(value) is not int or not low <= value < 2**63):
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r:.40}")
            return value

        name = rec.get(NODE_NAME)
        if name is not None and not (isinstance(name, str) and len(name) <= 200):
            raise ValueError(f"{NODE_NAME} must be a name of at most 200 characters, got {name!r:.40}")
        capability = {k[len(CAPABILITY) :]: v for k, v in rec.items() if k.startswith(CAPABILITY)}
        for key, value in capability.items():
            if type(value) not in (int, float) or not 0 <= value < math.inf:
                raise ValueError(f"{CAPABILITY}{key} must be a finite number >= 0, got {value!r:.40}")
        return cls(
            partition_id=whole(PARTITION_ID, 0),
            num_partitions=whole(NUM_PARTITIONS, 1),
            name=name or None,
            capability={k: float(v) for k, v in capability.items()},
            examples=whole(NUM_EXAMPLES, 0),
        )


def train_metrics(
    num_examples: int,
    loss: float,
    accuracy: float,
    seconds: float,
    level: float,
    class_counts: Sequence[int],
    ray_node: str | None = None,
) -> MetricRecord:
    """A training reply's metrics; ``ray_node``: the hex id of the Ray node that trained (simulation)."""
    out: dict[str, MetricRecordValues] = {
        NUM_EXAMPLES: int(num_examples),
        TRAIN_LOSS: float(loss),
        TRAIN_ACCURACY: float(accuracy),
        SECONDS: float(seconds),
        LEVEL: float(level),
        CLASS_COUNTS: [int(c) for c in class_counts],
    }
    if ray_node:
        out[RAY_NODE] = ray_node_number(ray_node)
    return MetricRecord(out)


def ray_node_number(node_id: str) -> int:
    """A Ray node id (hex) as the integer a metric can carry: its first 12 hex digits (48 bits, exact
    in a float64 too)."""
    return int(node_id[:12], 16)


def eval_metrics(num_examples: int, loss: float, accuracy: float) -> MetricRecord:
    """An evaluation reply's metrics (the node's held-out examples)."""
    return MetricRecord({NUM_EXAMPLES: int(num_examples), EVAL_LOSS: float(loss), EVAL_ACCURACY: float(accuracy)})


def read_eval(metrics: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(num-examples, eval-loss, eval-accuracy) of an evaluation reply, None where missing."""
    return metrics.get(NUM_EXAMPLES), metrics.get(EVAL_LOSS), metrics.get(EVAL_ACCURACY)


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


# replies: who was asked, why one failed

#: the reason recorded for a node the SuperLink answered for: it missed its heartbeats (Flower's
#: ``NODE_UNAVAILABLE`` error reply, sent by the SuperLink itself, not by the node)
NODE_UNAVAILABLE = "node unavailable"


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


# ---------------------------------------------------------------------- the server's side of a round


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


def exchange(
    grid: Any, messages: list[Message], timeout: float | Deadline, poll: float = 0.01, max_poll: float = 0.1
) -> list[Message]:
    """Push all ``messages`` at once, then pull their replies until all came or the deadline passed
    (:func:`collect`). Like ``Grid.send_and_receive``, but polling from ``poll`` seconds, doubling
    up to ``max_poll`` (Flower's loop sleeps 3 s between pulls: every exchange ends up to 3 s
    after its last reply)."""
    return collect(grid, push(grid, messages), timeout, poll, max_poll)
