"""The in-process grid (fedhm_flwr/ops/apps/local_grid.py) keeps each node's side to itself, as separate
processes would: a handler's torch thread count does not leak into the server's side of the round."""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedhm_flwr.ops.apps.local_grid import LocalGrid


def _query(node_id: int) -> Message:
    return Message(
        content=RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=node_id, message_type=MessageType.QUERY
    )


def test_a_handlers_thread_count_stays_with_its_node_even_when_it_crashes():
    server = torch.get_num_threads()
    node_threads = 1 if server > 1 else 2
    seen = []

    def handler(msg, context):
        torch.set_num_threads(node_threads)  # as the training handler does (simulation.num_cpus)
        seen.append(torch.get_num_threads())
        if context.node_id % 2:
            raise RuntimeError("node crashed after setting its threads")
        return Message(RecordDict({"config": ConfigRecord({"ok": 1})}), reply_to=msg)

    grid = LocalGrid(3, {MessageType.QUERY: handler}, first_node_id=10)
    try:
        replies = list(grid.send_and_receive([_query(n) for n in grid.get_node_ids()]))
        assert seen == [node_threads] * 3  # each node computed on its own count
        assert sorted(r.has_error() for r in replies) == [False, False, True]  # node 17 crashed
        assert torch.get_num_threads() == server
    finally:
        torch.set_num_threads(server)
