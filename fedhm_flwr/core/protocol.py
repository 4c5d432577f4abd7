"""The one wire contract between the server and the nodes: record names, message keys, and the
encode/decode of what both sides must read alike (node info, training and evaluation replies).

Every message is a Flower ``RecordDict`` with at most three records: ``arrays`` (model tensors),
``config`` (what the server tells a node: task, specs, queries) and ``metrics`` (what a node
reports); a bn-stats query and its reply hold one ``arrays.<i>`` record per model instead
(:mod:`fedhm_flwr.core.bn_wire`: every level's model in one message). The server writes task configs and
reads replies; the ClientApp reads task configs and writes replies; both import the names from
here, so a key is spelled in one place. The server's side of the exchange (pushing, pulling, the
round's deadline, matching replies to the nodes asked) is :mod:`fedhm_flwr.server.transport`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ConfigRecord, MetricRecord
from flwr.app.typing import MetricRecordValues

# arrays on the wire, re-exported as part of the contract (wire.wire_array, wire.record_tensors, ...)
from fedhm_flwr.core.wire_arrays import (
    WIRE_DTYPES as WIRE_DTYPES,
    array_record as array_record,
    from_wire as from_wire,
    npy_header as npy_header,
    record_tensors as record_tensors,
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
#: a simulated node's node-info reply (its metrics record; wall clock, the server's machine): when its
#: worker process started, finished importing the ClientApp, and answered
WORKER_STARTED_AT, WORKER_IMPORTED_AT, ANSWERED_AT = "worker-started-at", "worker-imported-at", "answered-at"


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
    num_examples: float,  # a count; training's statistics hold it as a float
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


def eval_metrics(num_examples: float, loss: float, accuracy: float) -> MetricRecord:
    """An evaluation reply's metrics (the node's held-out examples)."""
    return MetricRecord({NUM_EXAMPLES: int(num_examples), EVAL_LOSS: float(loss), EVAL_ACCURACY: float(accuracy)})


def read_eval(metrics: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(num-examples, eval-loss, eval-accuracy) of an evaluation reply, None where missing."""
    return metrics.get(NUM_EXAMPLES), metrics.get(EVAL_LOSS), metrics.get(EVAL_ACCURACY)


def worker_marks(started: float | None, imported: float, answered: float) -> MetricRecord:
    """A simulated node's start-up marks, for its node-info reply's metrics record."""
    marks = {WORKER_IMPORTED_AT: float(imported), ANSWERED_AT: float(answered)}
    return MetricRecord({**marks, **({WORKER_STARTED_AT: float(started)} if started is not None else {})})


#: node-info reply metric -> the start-up mark its earliest value gives (reporting/startup.py)
FIRST_MARKS = {
    WORKER_STARTED_AT: "worker_started_at",
    WORKER_IMPORTED_AT: "worker_imported_at",
    ANSWERED_AT: "first_answered_at",
}


def first_marks(
    replies: Sequence[Mapping[str, Any]], marks: Mapping[str, float], arrived: float = math.inf
) -> dict[str, float]:
    """``marks`` with each :data:`FIRST_MARKS` mark moved to the earliest value that the metrics of
    node-info replies (their contents) give (untrusted input: a value that is not a finite float is
    passed over), and ``first_arrived_at`` to ``arrived`` (when the server pulled the first of them) if
    that is earlier."""
    out = dict(marks)
    if arrived < out.get("first_arrived_at", math.inf):
        out["first_arrived_at"] = arrived
    for content in replies:
        record = content.get(METRICS)
        if not isinstance(record, Mapping):
            continue
        for key, mark in FIRST_MARKS.items():
            value = record.get(key)
            if type(value) is float and math.isfinite(value) and value < out.get(mark, math.inf):
                out[mark] = value
    return out
