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
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

# arrays on the wire, re-exported as part of the contract (wire.wire_array, wire.record_tensors, ...)
from fedhm_flwr.core.wire_arrays import (WIRE_DTYPES, array_record, from_wire, npy_header, record_tensors, reply_tensors,
                                         wire_array)

if TYPE_CHECKING:  # torch is imported where tensors are converted: the config check imports this module
    import torch

# records
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"

# queries (config["query"] of a QUERY message)
QUERY = "query"
NODE_INFO, BN_STATS = "node-info", "bn-stats"
#: a bn-stats query carries any number of models in one message (every level's at once): their specs
#: in config[MODEL_SPECS] (a list), model i's arrays in the record ``bn_wire.bn_record(i)``; the reply
#: holds model i's sums in the record of the same name
MODEL_SPECS = "model-specs"

# task config keys (server -> node)
SERVER_ROUND, METHOD, LEVEL, LEVEL_INDEX = "server-round", "method", "level", "level-index"
MODEL_SPEC, DATA_SPEC, TRAIN, SEED, BATCH_SIZE = "model-spec", "data-spec", "train", "seed", "batch-size"
WIRE_DTYPE = "wire-dtype"  # dtype of the arrays both ways (wire.dtype); absent: float32
INJECT, INJECT_SECONDS = "inject", "inject-seconds"  # failure injection (failures.*)
ATTACK, ATTACK_SCALE = "attack", "attack-scale"  # attack injection (failures.attack)

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
        return cls(
            partition_id=int(rec[PARTITION_ID]) if PARTITION_ID in rec else None,
            num_partitions=int(rec[NUM_PARTITIONS]) if NUM_PARTITIONS in rec else None,
            name=str(rec[NODE_NAME]) if rec.get(NODE_NAME) else None,
            capability={k[len(CAPABILITY):]: float(v) for k, v in rec.items() if k.startswith(CAPABILITY)},
            examples=int(rec[NUM_EXAMPLES]) if NUM_EXAMPLES in rec else None,
        )


def train_metrics(num_examples: int, loss: float, accuracy: float, seconds: float, level: float,
                  class_counts: Sequence[int], ray_node: str | None = None) -> MetricRecord:
    """A training reply's metrics; ``ray_node``: the hex id of the Ray node that trained (simulation)."""
    out = {NUM_EXAMPLES: int(num_examples), TRAIN_LOSS: float(loss), TRAIN_ACCURACY: float(accuracy),
           SECONDS: float(seconds), LEVEL: float(level), CLASS_COUNTS: [int(c) for c in class_counts]}
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
    if CONFIG not in msg.content:
        return NodeInfo(node_id=node_id)
    return dataclasses.replace(NodeInfo.decode(msg.content[CONFIG]), node_id=node_id)


def node_info_queries(node_ids: list[int], data_spec: str | None = None) -> list[Message]:
    """One ``node-info`` query per node; with the run's data spec (JSON), each node also reports
    how many training examples it holds for it (and finds its data before the first round)."""
    config = {QUERY: NODE_INFO, **({DATA_SPEC: data_spec} if data_spec else {})}
    return [Message(content=RecordDict({CONFIG: ConfigRecord(config)}), dst_node_id=n,
                    message_type=MessageType.QUERY) for n in node_ids]


# replies: who was asked, why one failed

#: the reason recorded for a node the SuperLink answered for: it missed its heartbeats (Flower's
#: ``NODE_UNAVAILABLE`` error reply, sent by the SuperLink itself, not by the node)
NODE_UNAVAILABLE = "node unavailable"


def asked_nodes(messages: list[Message], replies: list[Message]) -> list[tuple[int, Message]]:
    """(the node that was asked, its reply) for each reply to these pushed ``messages``.

    A reply is matched to the message it answers, never to its sender: the SuperLink answers
    itself for a node that missed its heartbeats (``Node Unavailable``, sent from the SuperLink's
    own node id). A reply to none of the messages keeps its sender."""
    asked = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
    return [(asked.get(r.metadata.reply_to_message_id, r.metadata.src_node_id), r) for r in replies]


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


class ArrayCache:
    """flwr Arrays of the tensors the server sends, serialised once per tensor and wire dtype.

    The global state is serialised once per model version: the ArrayRecord ``aggregate_train``
    returns, the levels' payloads and the evaluation's models all reuse the Arrays of the tensors
    they share with it. A tensor is recognised by its storage (a detached view of a global tensor
    counts as the same) and its version counter (an in-place change makes it new). Holds the last
    tensor and Array per key and dtype."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[torch.Tensor, int, Any]] = {}
        self.serialized: Counter[str] = Counter()  # key -> times a tensor of it was serialised

    @staticmethod
    def _same(held: torch.Tensor, version: int, tensor: torch.Tensor) -> bool:
        return held is tensor and held._version == version or (
            held.data_ptr() == tensor.data_ptr() and held.dtype == tensor.dtype and held.device == tensor.device
            and held.shape == tensor.shape and held.stride() == tensor.stride() and tensor._version == version)

    def arrays(self, state: Mapping[str, torch.Tensor], dtype: str = "float32") -> dict[str, Any]:
        out = {}
        for key, tensor in state.items():
            held = self._held.get((key, dtype))
            if held is None or not self._same(held[0], held[1], tensor):
                held = self._held[(key, dtype)] = (tensor, tensor._version, wire_array(tensor, dtype))
                self.serialized[key] += 1
            out[key] = held[2]
        return out


@dataclass
class Payload:
    """One model as it is sent this round: its spec and its arrays (shared by the nodes it goes to)."""

    spec: dict[str, Any]
    arrays: dict[str, Any]  # name -> flwr Array (immutable, shared between fresh records)
    shapes: dict[str, tuple[int, ...]]
    train: dict[str, Any] = field(default_factory=dict)  # method-specific client options
    returned: tuple[str, ...] | None = None  # keys a reply must hold (None: the keys sent)
    _record: Any = field(default=None, init=False, repr=False, compare=False)  # what record() copies
    _bytes: int | None = field(default=None, init=False, repr=False, compare=False)  # record_bytes()
    _expected: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)  # expected_keys()

    def _held(self) -> Any:
        """The ArrayRecord of the payload's Arrays, made once (Flower checks every entry it is given)."""
        if self._record is None:
            self._record = array_record(self.arrays)
        return self._record

    def record(self) -> Any:
        """A fresh ArrayRecord of the payload's Arrays: a copy (``ArrayRecord.copy``) of the one made
        once (the Arrays themselves are shared, never changed)."""
        return self._held().copy()

    def record_bytes(self) -> int:
        """Bytes of :meth:`record`'s ArrayRecord (``count_bytes``; counted once: the Arrays never change)."""
        if self._bytes is None:
            self._bytes = self._held().count_bytes()
        return self._bytes

    def expected_keys(self) -> frozenset[str]:
        """The keys a reply must hold: ``returned``, else the keys sent (made once)."""
        if self._expected is None:
            self._expected = frozenset(self.returned if self.returned is not None else self.shapes)
        return self._expected


def train_options(distill: Mapping[str, Any] | None) -> dict[str, Any]:
    """The train options of ``train.distill = {enabled, temperature, weight}`` (none: off)."""
    if distill is None:
        return {}
    return {"distill": bool(distill["enabled"]), "distill_temperature": float(distill["temperature"]),
            "distill_weight": float(distill["weight"])}


class TaskConfigs:
    """The rounds' training task configs. What every node of a level (and partition count) is told
    alike is encoded once while it stays the same: the round's train options once per round, and
    the whole record (model spec and train options as JSON, the data spec per partition count) once
    per level and partition count, until its spec or train options change (Flower checks every entry
    it is given; a new round only changes the round number of a copy). Each node gets a copy of it
    (``ConfigRecord.copy``, no second check) with its own seed; its bytes are counted once too (the
    round number and seed are ints: every copy has the bytes of the one it was copied from)."""

    def __init__(self) -> None:
        self._round: int | None = None
        self._options: dict[str, Any] | None = None
        # this round's: (payload id, partitions, level index) -> (payload, record, bytes)
        self._train: dict[tuple[int, int | None, int], tuple[Payload, ConfigRecord, int]] = {}
        # across rounds: (level index, partitions) -> (what it encodes, record, bytes)
        self._made: dict[tuple[int, int | None], tuple[tuple[Any, ...], ConfigRecord, int]] = {}
        self._data: dict[int | None, str] = {}

    def train(self, server_round: int, method: str, level: float, level_index: int, payload: Payload,
              options: Callable[[], dict[str, Any]], num_partitions: int | None,
              data_spec: Callable[[int | None], dict[str, Any]], seed: int, dtype: str) -> tuple[ConfigRecord, int]:
        """The TRAIN task config of one node (``options()``: the round's train options) and its
        bytes (``count_bytes``)."""
        if self._round != server_round:  # the data specs stay: they do not change with the round
            self._round, self._options, self._train = server_round, None, {}
        held = self._train.get((id(payload), num_partitions, level_index))
        if held is None or held[0] is not payload:
            if self._options is None:
                self._options = options()
            said = (method, level, payload.spec, {**self._options, **payload.train}, dtype)
            made = self._made.get((level_index, num_partitions))
            if made is None or made[0] != said:
                if num_partitions not in self._data:
                    self._data[num_partitions] = json.dumps(data_spec(num_partitions))
                record = ConfigRecord({SERVER_ROUND: server_round, METHOD: method, LEVEL: level,
                                       LEVEL_INDEX: level_index, MODEL_SPEC: json.dumps(payload.spec),
                                       TRAIN: json.dumps(said[3]), DATA_SPEC: self._data[num_partitions],
                                       SEED: seed, **wire_config(dtype)})
                made = self._made[(level_index, num_partitions)] = (said, record, record.count_bytes())
            record = made[1].copy()
            record[SERVER_ROUND] = server_round
            held = self._train[(id(payload), num_partitions, level_index)] = (payload, record, made[2])
        config = held[1].copy()
        config[SEED] = seed
        return config, held[2]


def check_train_reply(content: RecordDict, payload: Payload, level: float, num_classes: int, dtype: str,
                      screen: Callable[[dict[str, torch.Tensor], torch.Tensor | None], str | None],
                      ) -> tuple[tuple[dict[str, torch.Tensor], int, Any, dict[str, float]] | None, str]:
    """A training reply checked against the payload sent: ((state in float32, num-examples,
    class counts, scalar metrics), "") or (None, why it is refused). Keys and shapes are checked
    before any tensor is read; ``screen(state, flat)`` refuses tensors (NaN/inf, oversized) by a
    reason (``flat``: every floating value of the reply in one tensor, or None,
    :func:`fedhm_flwr.core.wire_arrays.reply_tensors`)."""
    if ARRAYS not in content or METRICS not in content:
        return None, f"reply lacks '{ARRAYS}' or '{METRICS}'"
    record = content[ARRAYS]
    expected, got = payload.expected_keys(), record.keys()
    if expected != got:
        missing, extra = sorted(expected - got), sorted(got - expected)
        return None, f"keys do not match level {level:g}: missing {missing[:3]}, unexpected {extra[:3]}"
    for key, array in record.items():  # shapes before any tensor is read
        if tuple(array.shape) != payload.shapes[key]:
            return None, f"{key} has shape {tuple(array.shape)}, level {level:g} needs {payload.shapes[key]}"
    state, flat = reply_tensors(record, dtype)  # back to float32
    refused = screen(state, flat)
    if refused:
        return None, refused
    metrics = content[METRICS]
    n = metrics.get(NUM_EXAMPLES)
    if not isinstance(n, (int, float)) or isinstance(n, bool) or not n > 0:
        return None, f"num-examples missing or not positive ({n!r})"
    raw = metrics.get(CLASS_COUNTS)
    # checked as the list it arrives as (the wire sends ints): a NaN or float count is refused, not
    # converted (numpy's int64 fails the whole round on NaN and truncates a float), and no numpy
    # call runs per reply before it passes
    if not (isinstance(raw, list) and len(raw) == num_classes and all(type(c) is int and 0 <= c < 2**63 for c in raw)):
        return None, f"class-counts must hold {num_classes} non-negative integer counts"
    counts = np.asarray(raw, dtype=np.int64)
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return (state, int(n), counts, scalars), ""


# ---------------------------------------------------------------------- pushing and pulling


def push(grid: Any, messages: list[Message]) -> list[str]:
    """Push ``messages`` (none: no call); the ids of those the grid took."""
    return [mid for mid in grid.push_messages(messages) if mid] if messages else []


def collect(grid: Any, message_ids: list[str], timeout: float, poll: float = 0.01,
            max_poll: float = 0.1, also: Sequence[str] = ()) -> list[Message]:
    """Pull the replies to these pushed messages until all came or ``timeout`` seconds passed;
    the replies to ``also`` are pulled along when they came, not waited for."""
    pending, extra = set(message_ids), set(also)
    replies: list[Message] = []
    end = time.monotonic() + timeout
    while pending:
        got = list(grid.pull_messages(list(pending | extra)))
        replies += got
        came = {m.metadata.reply_to_message_id for m in got}
        pending -= came
        extra -= came
        if not pending or time.monotonic() >= end:
            break
        time.sleep(poll)
        poll = min(2 * poll, max_poll)
    return replies


def exchange(grid: Any, messages: list[Message], timeout: float, poll: float = 0.01,
             max_poll: float = 0.1) -> list[Message]:
    """Push all ``messages`` at once, then pull their replies until all came or ``timeout``
    seconds passed. Like ``Grid.send_and_receive``, but polling from ``poll`` seconds, doubling
    up to ``max_poll`` (Flower's loop sleeps 3 s between pulls: every exchange ends up to 3 s
    after its last reply)."""
    return collect(grid, push(grid, messages), timeout, poll, max_poll)
