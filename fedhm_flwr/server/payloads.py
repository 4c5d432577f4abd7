"""What the server sends in a round, made once and shared: the Arrays of the tensors it sends
(:class:`ArrayCache`, serialised once per model version), a level's model as sent
(:class:`Payload`) and the nodes' training task configs (:class:`TaskConfigs`, encoded once per
level while they stay the same). The keys they use are the wire contract's
(:mod:`fedhm_flwr.core.protocol`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ConfigRecord

from fedhm_flwr.config.options.run import Distill
from fedhm_flwr.core.protocol import DATA_SPEC, LEVEL, LEVEL_INDEX, METHOD, MODEL_SPEC, SEED, SERVER_ROUND, TRAIN
from fedhm_flwr.core.wire_arrays import array_record, wire_array
from fedhm_flwr.server.transport import wire_config


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
        return (held is tensor and held._version == version) or (
            held.data_ptr() == tensor.data_ptr()
            and held.dtype == tensor.dtype
            and held.device == tensor.device
            and held.shape == tensor.shape
            and held.stride() == tensor.stride()
            and tensor._version == version
        )

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


def train_options(distill: Distill) -> dict[str, Any]:
    """The train options of ``train.distill = {enabled, temperature, weight}``."""
    return {"distill": distill.enabled, "distill_temperature": distill.temperature, "distill_weight": distill.weight}


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

    def train(
        self,
        server_round: int,
        method: str,
        level: float,
        level_index: int,
        payload: Payload,
        options: Callable[[], dict[str, Any]],
        num_partitions: int | None,
        data_spec: Callable[[int | None], dict[str, Any]],
        seed: int,
        dtype: str,
    ) -> tuple[ConfigRecord, int]:
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
                record = ConfigRecord(
                    {
                        SERVER_ROUND: server_round,
                        METHOD: method,
                        LEVEL: level,
                        LEVEL_INDEX: level_index,
                        MODEL_SPEC: json.dumps(payload.spec),
                        TRAIN: json.dumps(said[3]),
                        DATA_SPEC: self._data[num_partitions],
                        SEED: seed,
                        **wire_config(dtype),
                    }
                )
                made = self._made[(level_index, num_partitions)] = (said, record, record.count_bytes())
            record = made[1].copy()
            record[SERVER_ROUND] = server_round
            held = self._train[(id(payload), num_partitions, level_index)] = (payload, record, made[2])
        config = held[1].copy()
        config[SEED] = seed
        return config, held[2]
