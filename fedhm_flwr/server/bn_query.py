"""The bn-stats query (docs/METHODS.md, sBN): the clients sum per-layer statistics of the models
they are sent over their local training data (at most ``evaluation.bn_examples`` examples each, a
subset drawn with the node's seed); the data never leaves them. Every model goes in one message per
node asked, answered in one reply; a reply that is not exactly the sums of every model asked is
refused whole (a warning names the node). A query is pushed when made and read by :meth:`BnQuery.sums`,
so that the server can work (evaluate) while the nodes compute.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore import log

from fedhm_flwr.core import bn_wire, protocol as wire
from fedhm_flwr.core.protocol import CONFIG
from fedhm_flwr.math import levels as lv
from fedhm_flwr.math.bn_stats import combine_bn_sums, norm_layers
from fedhm_flwr.models import build_model, shape_device
from fedhm_flwr.server.methods.method import State
from fedhm_flwr.server.replies import round_deadline
from fedhm_flwr.server.reply_arrays import check_bn_reply
from fedhm_flwr.server.transport import asked_nodes, collect, error_reason, push

Sums = dict[str, torch.Tensor]


def spec_key(spec: dict[str, Any]) -> str:
    """A model spec as a canonical string (a cache key)."""
    return json.dumps(spec, sort_keys=True, default=str)


@functools.lru_cache(maxsize=32)
def _sum_shapes(spec_json: str) -> dict[str, tuple[int, ...]]:
    """The arrays a node's sums of the model ``spec_json`` may hold (key -> shape)."""
    spec = json.loads(spec_json)
    with shape_device(spec):
        layers = norm_layers(build_model(spec, spectral_init=False))
    return bn_wire.bn_sum_shapes({name: int(layer.num_features) for name, layer in layers.items()})


def asked_nodes_of(view: Any) -> list[int]:
    """The nodes a bn-stats query of this round asks: a seeded sample of ``evaluation.bn_clients``
    of the connected nodes (all of them at 0 or when fewer are connected), in node order."""
    node_ids = sorted(view.registry.nodes, key=view.registry.key)
    limit = view.opts.evaluation.bn_clients
    if 0 < limit < len(node_ids):
        rng = lv.round_rng(view.opts.seed, view.server_round, stream=3)
        node_ids = [node_ids[i] for i in sorted(rng.choice(len(node_ids), size=limit, replace=False))]
    return node_ids


class BnQuery:
    """One bn-stats query of these ``models`` (spec, state), pushed to the nodes asked when made;
    ``view``: the round's :class:`fedhm_flwr.server.evaluation.RoundView`."""

    def __init__(self, view: Any, models: Sequence[tuple[dict[str, Any], State]]) -> None:
        self.view, self.count = view, len(models)
        grid, nodes, opts = view.grid, view.registry.nodes, view.opts
        if grid is None:
            raise RuntimeError("federated sBN statistics need the grid (configure_train runs first)")
        node_ids = asked_nodes_of(view)
        specs = [json.dumps(spec) for spec, _ in models]
        arrays = [view.arrays(state) for _, state in models]  # the wire dtype, serialised once (ArrayCache)
        self.expected = [_sum_shapes(spec_key(spec)) for spec, _ in models]
        examples = opts.evaluation.bn_examples  # per node, a seeded subset of its training examples (0: all)
        self.bytes, self.messages = 0, []
        for node_id in node_ids:
            config = ConfigRecord(
                {
                    wire.QUERY: wire.BN_STATS,
                    wire.MODEL_SPECS: specs,
                    wire.DATA_SPEC: json.dumps(opts.data_spec(nodes[node_id].num_partitions)),
                    wire.BATCH_SIZE: opts.train.batch_size,
                    wire.BN_EXAMPLES: examples,
                    wire.SEED: lv.client_seed(opts.seed, view.server_round, view.registry.key(node_id)),
                    **view.wire_config,
                }
            )
            content = RecordDict({CONFIG: config})
            for index, model_arrays in enumerate(arrays):
                record = ArrayRecord.from_array_dict(model_arrays)  # fresh record, shared bytes
                self.bytes += record.count_bytes()
                content[bn_wire.bn_record(index)] = record
            self.messages.append(Message(content=content, dst_node_id=node_id, message_type=MessageType.QUERY))
        self.pushed = push(grid, self.messages)

    def sums(self) -> tuple[list[Sums | None], int]:
        """(each model's summed per-layer statistics, None where no node answered; bytes moved):
        the replies pulled until all came or the round's deadline passed (``stragglers.*``)."""
        view = self.view
        replies = collect(view.grid, self.pushed, round_deadline(view.opts), max_poll=0.5)
        parts: list[list[Sums]] = [[] for _ in range(self.count)]
        for node_id, reply in sorted(asked_nodes(self.messages, replies), key=lambda pair: view.registry.key(pair[0])):
            try:  # (sums in node order)
                sums, why = (
                    (None, error_reason(reply)) if reply.has_error() else check_bn_reply(reply.content, self.expected)
                )
            except Exception as exc:  # noqa: BLE001 (no reply can raise out of the round)
                sums, why = None, f"reply could not be read: {type(exc).__name__}: {exc}"
            if sums is None:
                log(WARNING, "bn-stats: node %s gave no statistics: %s", view.registry.label(node_id), why)
                continue
            self.bytes += sum(reply.content[bn_wire.bn_record(i)].count_bytes() for i in range(self.count))
            for part, model_sums in zip(parts, sums):
                part.append(model_sums)
        return [combine_bn_sums(part) if part else None for part in parts], self.bytes


def federated_bn_sums(view: Any, models: Sequence[tuple[dict[str, Any], State]]) -> tuple[list[Sums | None], int]:
    """:class:`BnQuery` of ``models``, waited for: (each model's sums or None, bytes moved)."""
    return BnQuery(view, models).sums()
