"""An in-process Flower Grid: messages go straight to a ClientApp's handlers, node by node.

For tests and benchmarks of the server round without Ray or a SuperLink. Real runs use the
simulation engine (``flwr run``) or SuperNodes; this grid only replaces the transport, so the
strategy, the messages and the client handlers are exactly the ones those runs use.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedhm_flwr.client import handlers as base
from fedhm_flwr.core.protocol import NUM_PARTITIONS, PARTITION_ID

Handler = Callable[[Message, Context], Message]


class LocalGrid(Grid):
    """``num_nodes`` simulated nodes with node configs like the simulation engine's.

    ``handlers`` maps a message type (``MessageType.TRAIN`` ...) to a handler; a handler that
    raises yields an error reply, as a crashing ClientApp does. ``node_config(i)`` may add keys
    to node ``i``'s config (e.g. a declared capability).
    """

    def __init__(
        self,
        num_nodes: int,
        handlers: dict[str, Handler],
        node_config: Callable[[int], dict[str, Any]] | None = None,
        first_node_id: int = 1001,
        timeout: float | None = None,
    ) -> None:
        self.handlers = handlers
        #: a handler running longer than this many seconds: its reply is lost (never pulled), as a
        #: node's that answers after the server stopped waiting (nodes work in parallel: each gets
        #: the whole timeout); None: every reply comes
        self.timeout = timeout
        for attr in ("run_id", "task_id", "node_id"):  # the identity the ServerApp process gets
            if getattr(TaskIdentity, f"_{attr}") is None:
                setattr(TaskIdentity, attr, 1)
        self.contexts: dict[int, Context] = {}
        for i in range(num_nodes):
            node_id = first_node_id + 7 * i
            config: dict[str, Any] = {PARTITION_ID: i, NUM_PARTITIONS: num_nodes}
            if node_config is not None:
                config.update(node_config(i))
            self.contexts[node_id] = Context(
                run_id=1, node_id=node_id, node_config=config, state=RecordDict(), run_config={}
            )
        self._ids = itertools.count(1)
        self._run = None
        self._replies: dict[str, Message | None] = {}  # message id -> reply not yet pulled
        self.delivered: list[tuple[int, str]] = []  # (node id, message type) in delivery order

    # -- the parts of the Grid API the strategies use

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's handler now; its reply waits for a pull."""
        ids = []
        for msg in messages:
            message_id = f"m{next(self._ids)}"
            msg.metadata.__dict__["_message_id"] = message_id  # the SuperLink's job
            self._replies[message_id] = self._deliver(msg)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies that arrived for these messages (each handed out once)."""
        return [reply for mid in message_ids if (reply := self._replies.pop(mid, None)) is not None]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        before = self.timeout
        self.timeout = before if timeout is None else timeout
        try:
            return list(self.pull_messages(self.push_messages(messages)))
        finally:
            self.timeout = before

    def _deliver(self, msg: Message) -> Message | None:
        """Run the node's handler; None when it answers after the timeout (a reply never seen)."""
        start = time.monotonic()  # nodes work in parallel: each gets the whole timeout
        node_id = msg.metadata.dst_node_id
        self.delivered.append((node_id, msg.metadata.message_type))
        handler = self.handlers.get(msg.metadata.message_type)
        threads = torch.get_num_threads()
        try:
            if handler is None:
                raise RuntimeError(f"no handler for {msg.metadata.message_type}")
            reply = handler(msg, self.contexts[node_id])
        except Exception as err:  # noqa: BLE001 (the ClientApp crashed: an error reply, like Flower's)
            reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
        finally:  # a node is its own process: the thread count its handler set stays there
            torch.set_num_threads(threads)
        late = self.timeout is not None and time.monotonic() - start > self.timeout
        return None if late else reply


def client_handlers() -> dict[str, Handler]:
    """The project's ClientApp handlers, keyed by message type."""
    return {
        MessageType.TRAIN: base.handle_train,
        MessageType.EVALUATE: base.handle_evaluate,
        MessageType.QUERY: base.handle_query,
    }
