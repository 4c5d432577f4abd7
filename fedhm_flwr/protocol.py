"""The one wire contract between the server and the nodes: record names, message keys, and the
encode/decode of what both sides must read alike (node info, training and evaluation replies).

Every message is a Flower ``RecordDict`` with at most three records: ``arrays`` (model tensors),
``config`` (what the server tells a node: task, specs, queries) and ``metrics`` (what a node
reports). The server writes task configs and reads replies; the ClientApp reads task configs and
writes replies; both import the names from here, so a key is spelled in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode

if TYPE_CHECKING:  # torch is imported where tensors are converted: the config check imports this module
    import torch

# records
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"

# queries (config["query"] of a QUERY message)
QUERY = "query"
NODE_INFO, BN_STATS = "node-info", "bn-stats"

# task config keys (server -> node)
SERVER_ROUND, METHOD, LEVEL, LEVEL_INDEX = "server-round", "method", "level", "level-index"
MODEL_SPEC, DATA_SPEC, TRAIN, SEED, BATCH_SIZE = "model-spec", "data-spec", "train", "seed", "batch-size"
WIRE_DTYPE = "wire-dtype"  # dtype of the arrays both ways (wire.dtype); absent: float32
INJECT, INJECT_SECONDS = "inject", "inject-seconds"  # failure injection (failures.*)
ATTACK, ATTACK_SCALE = "attack", "attack-scale"  # attack injection (failures.attack)

# node config keys (a node's own settings) and its node-info reply
PARTITION_ID, NUM_PARTITIONS, NODE_NAME, DATA_DIR = "partition-id", "num-partitions", "node-name", "data-dir"
CAPABILITY = "capability-"  # prefix: capability-level, -params, -macs, -memory

# reply metric keys (node -> server)
NUM_EXAMPLES, CLASS_COUNTS, SECONDS = "num-examples", "class-counts", "seconds"
TRAIN_LOSS, TRAIN_ACCURACY = "train-loss", "train-accuracy"
EVAL_LOSS, EVAL_ACCURACY = "eval-loss", "eval-accuracy"
RAY_NODE = "ray-node"  # simulation: the first 12 hex digits of the Ray node id the client ran on, as an int


# arrays on the wire (wire.dtype): floating tensors travel in this dtype, the rest as they are.
# Flower's Array holds numpy data and numpy has no bfloat16: a bfloat16 tensor travels as its
# raw 16 bits in an int16 array, which the receiver (told the wire dtype) reinterprets.
WIRE_DTYPES = ("float32", "float16", "bfloat16")


def wire_array(tensor: torch.Tensor, dtype: str = "float32") -> Array:
    """One tensor as a flwr Array in the wire dtype (floating tensors cast, others unchanged).

    The bytes are what Flower's ``Array.from_torch_tensor`` writes (``np.save``: a ``.npy`` header,
    then the data in C order), put together here from the header of the tensor's dtype and shape
    (:func:`npy_header`, made once per dtype and shape) and the tensor's bytes: ``np.save`` costs a
    header formatted per call, several times the copy at the CNN's sizes."""
    import torch

    tensor = tensor.detach()
    if tensor.is_floating_point():
        tensor = tensor.to(getattr(torch, dtype))
        if dtype == "bfloat16":
            tensor = tensor.view(torch.int16)
    ndarray = tensor.contiguous().cpu().numpy()
    name, shape = str(ndarray.dtype), tuple(ndarray.shape)
    header = npy_header(name, shape)
    if header is None:
        return Array.from_numpy_ndarray(ndarray)
    return Array(dtype=name, shape=shape, stype="numpy.ndarray", data=header + ndarray.tobytes())


_NPY_HEADERS: dict[tuple[str, tuple[int, ...]], bytes | None] = {}


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes | None:
    """The ``.npy`` header ``np.save`` writes before a C-ordered array of this dtype (numpy's name,
    as an Array holds it) and shape (format 1.0, numpy's own writer), or None for a dtype it would
    pickle or a header that needs a later format. Cached: one per dtype and shape (a model has a
    few dozen)."""
    key = (dtype, shape)
    if key not in _NPY_HEADERS:
        import io

        import numpy as np

        dtype = np.dtype(dtype)
        header = None
        if not dtype.hasobject:
            buffer = io.BytesIO()
            try:
                np.lib.format.write_array_header_1_0(
                    buffer, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
                header = buffer.getvalue()
            except ValueError:  # a header too long for format 1.0: np.save's own choice decides
                header = None
        _NPY_HEADERS[key] = header
    return _NPY_HEADERS[key]


def array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """A fresh ArrayRecord holding these Arrays themselves (an Array is never changed once made, so
    records of one payload share its Arrays and their bytes; Flower's ``from_array_dict`` rebuilds
    every Array, with its argument checks, for every record)."""
    record = ArrayRecord()
    for key, array in arrays.items():
        record[key] = array
    return record


def record_tensors(record: Any) -> dict[str, torch.Tensor]:
    """An ArrayRecord's tensors, each copied once out of its Array's bytes.

    Flower's ``to_torch_state_dict`` parses every array's ``.npy`` header with ``np.load`` (a third
    of a round's aggregation at ResNet-18 size); here an array whose bytes are the header
    :func:`npy_header` makes for its own dtype and shape followed by the data is read from after
    that header; an array whose header differs only in its padding or form (another numpy's
    ``np.save``) but declares the Array's dtype in C order is read from the end of its bytes (where
    ``np.save`` puts the data); anything else goes through ``Array.numpy()``."""
    import numpy as np
    import torch

    out = {}
    for key, array in record.items():
        tensor = None
        if array.stype == "numpy.ndarray":
            try:
                dtype = np.dtype(array.dtype)
            except TypeError:
                dtype = None
            if dtype is not None and not dtype.hasobject:
                shape, data = tuple(array.shape), array.data
                count = math.prod(shape)
                offset = len(data) - dtype.itemsize * count
                known = npy_header(array.dtype, shape)
                if not (known is not None and offset == len(known) and data.startswith(known)):
                    header = bytes(data[:min(max(offset, 0), 4096)])
                    if not (offset > 0 and header.startswith(b"\x93NUMPY") and b"'fortran_order': False" in header
                            and f"'descr': '{dtype.str}'".encode() in header and f"'shape': {shape}".encode() in header):
                        offset = -1
                if offset >= 0:
                    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
                    tensor = torch.from_numpy(flat.copy()).view(shape)
        out[key] = tensor if tensor is not None else torch.from_numpy(array.numpy())
    return out


def from_wire(state: Mapping[str, torch.Tensor], dtype: str = "float32") -> dict[str, torch.Tensor]:
    """A state dict received in the wire dtype, back in float32 (other tensors unchanged)."""
    import torch

    out = {}
    for key, tensor in state.items():
        if dtype == "bfloat16" and tensor.dtype == torch.int16:
            tensor = tensor.view(torch.bfloat16)
        out[key] = tensor.float() if tensor.is_floating_point() else tensor
    return out


@dataclass
class NodeInfo:
    """What a node tells the server about itself (its ``node-info`` reply)."""

    partition_id: int | None = None
    num_partitions: int | None = None
    name: str | None = None
    capability: dict[str, float] = field(default_factory=dict)
    #: training examples the node holds for the data spec the query carried (None: not asked)
    examples: int | None = None

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
