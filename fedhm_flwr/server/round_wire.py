"""The round's wire: what each node is sent and how its reply is checked against it (a collaborator
of :class:`fedhm_flwr.server.strategy.HeteroStrategy`, which holds one).

A payload is the node's own cut when the method makes one (PriSM), else its level's, cut once per
level per round and shared; it travels in ``wire.dtype`` (:mod:`~fedhm_flwr.server.payloads`:
the Arrays serialised once per model version, the task config once per level). A reply is checked
against what that node was sent (:func:`fedhm_flwr.server.replies.check_train_reply`) before the
method sees it. The wire keeps what it sent this round (``sent``, ``messages``) and, across rounds, the
messages of nodes recorded late (``pending``, :mod:`~fedhm_flwr.server.late`): pulled with every later
round's replies, an answer to one is a late arrival, the SuperLink's ``NODE_UNAVAILABLE`` the verdict on its
round (:meth:`RoundWire.sort_replies`); what is still pending after the last round is settled once
(:meth:`RoundWire.settle_late`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core import protocol as wire
from fedhm_flwr.core.protocol import ARRAYS, CONFIG
from fedhm_flwr.math import levels as lv
from fedhm_flwr.server import replies as reply_checks
from fedhm_flwr.server.known_nodes import KnownNodes
from fedhm_flwr.server.late import Lost, PendingLate
from fedhm_flwr.server.methods.method import Cut, Method, Reply, State
from fedhm_flwr.server.payloads import ArrayCache, Payload, TaskConfigs, train_options
from fedhm_flwr.server.report import RoundLog
from fedhm_flwr.server.simulated_attacks import Attacks
from fedhm_flwr.server.transport import late_verdicts, settle_late
from fedhm_flwr.server.untrusted import Untrusted


class RoundWire:
    """Payloads out, replies checked (see the module docstring)."""

    def __init__(
        self, opts: RunOptions, method: Method, known: KnownNodes, attacks: Attacks, untrusted: Untrusted
    ) -> None:
        self.opts, self.method, self.known, self.attacks, self.untrusted = opts, method, known, attacks, untrusted
        self.levels = method.levels
        self.wire_dtype = opts.wire.dtype  # arrays both ways
        self.array_cache = ArrayCache()
        self.tasks = TaskConfigs()
        self._fixed_options: dict[str, Any] | None = None  # the train options but the round's lr
        self.lr = opts.lr_schedule()  # the round's lr
        self._global_record: ArrayRecord | None = None  # the record last made of the global state
        self._global_state: State | None = None  # (that state)
        self._examples_cap = reply_checks.examples_cap(opts)  # the most examples a reply's weight counts
        self.sent: dict[int, tuple[int, Payload]] = {}  # node id -> (level index, payload) this round
        self.messages: list[Message] = []  # this round's training messages (their ids: who was asked)
        self.pending = PendingLate()  # the messages of nodes recorded late, any round's, not answered or judged
        #: how long the run's end waits for the SuperLink's verdict on the nodes still late (:meth:`settle_late`):
        #: on devices the ServerApp sets ``stragglers.verdict_seconds``; 0 (one more pull) in a simulation
        self.verdict_wait = 0.0

    def wire_arrays(self, state: State) -> dict[str, Any]:
        """A model the server sends (payload, evaluation), as Arrays in the wire dtype."""
        return self.array_cache.arrays(state, self.wire_dtype)

    def global_record(self, state: State) -> ArrayRecord:
        """The global state as the round's ArrayRecord (float32: the server keeps float32)."""
        self._global_record = wire.array_record(self.array_cache.arrays(state, "float32"))
        self._global_state = state
        return self._global_record

    def state_of(self, arrays: ArrayRecord) -> State:
        """The state an ArrayRecord holds: the global state itself when the record was made of it
        (no second deserialisation), else the record's tensors in float32."""
        if arrays is self._global_record and self._global_state is not None:
            return self._global_state
        return arrays.to_torch_state_dict()

    def _payload(self, cut: Cut) -> Payload:
        return Payload(
            cut.spec,
            self.wire_arrays(cut.state),
            {k: tuple(v.shape) for k, v in cut.state.items()},
            cut.train,
            cut.returned,
        )

    def node_payload(
        self, node_id: int, level_index: int, global_state: State, level_payloads: dict[int, Payload]
    ) -> Payload:
        """The payload sent to one node this round: the node's own cut when the method makes one
        (PriSM), else its level's, cut once per level per round and shared (``level_payloads``)."""
        cut = self.method.node_cut(node_id, self.known.key(node_id), level_index, global_state)
        if cut is not None:
            return self._payload(cut)
        if level_index not in level_payloads:
            level_payloads[level_index] = self._payload(self.method.level_cut(level_index, global_state))
        return level_payloads[level_index]

    def round_train_options(self, server_round: int) -> dict[str, Any]:
        """The ``train.*`` options every client of round ``server_round`` is sent (its learning rate included)."""
        if self._fixed_options is None:  # built once: the same every round
            train = self.opts.train
            self._fixed_options = {
                "local_epochs": train.local_epochs,
                "batch_size": train.batch_size,
                "momentum": train.momentum,
                "weight_decay": train.weight_decay,
                "masked_ce": train.masked_ce,
                "grad_clip": train.grad_clip,
                "threads": max(1, int(math.floor(self.opts.simulation.num_cpus))),
                **train_options(train.distill),
            }
        return {"lr": self.lr(server_round), **self._fixed_options}

    def _train_config(self, server_round: int, node_id: int, index: int, payload: Payload) -> tuple[ConfigRecord, int]:
        return self.tasks.train(
            server_round,
            self.method.name,
            self.levels[index],
            index,
            payload,
            lambda: self.round_train_options(server_round),
            self.known.nodes[node_id].num_partitions,
            self.opts.data_spec,
            lv.client_seed(self.attacks.seed, server_round, self.known.key(node_id)),
            self.wire_dtype,
        )

    def train_messages(
        self,
        server_round: int,
        levels: dict[int, int],
        global_state: State,
        injected: dict[int, str],
        attackers: set[int],
        rl: RoundLog,
    ) -> list[Message]:
        """One fresh training message per node (``levels``: node id -> its level index this round, in
        the round's order): its payload and task config, with the failure it is asked to simulate
        (``injected``) or the attack (``attackers``); what it sends is counted in ``rl``."""
        payloads: dict[int, Payload] = {}
        self.sent = {}
        messages = []
        for node_id, index in levels.items():
            payload = self.node_payload(node_id, index, global_state, payloads)
            config, config_bytes = self._train_config(server_round, node_id, index, payload)
            if node_id in injected:
                config[wire.INJECT] = injected[node_id]
                config[wire.INJECT_SECONDS] = self.opts.failures.slow_seconds
            if node_id in attackers:
                config.update(self.attacks.train_config())
            content = RecordDict({ARRAYS: payload.record(), CONFIG: config})  # (fresh record, shared Arrays)
            rl.sent_bytes += payload.record_bytes() + (  # (content_bytes)
                config.count_bytes() if node_id in injected or node_id in attackers else config_bytes
            )
            self.sent[node_id] = (index, payload)
            messages.append(Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN))
        self.messages = messages
        return messages

    @property
    def late_ids(self) -> list[str]:
        """The messages of nodes recorded late and not answered or judged yet: every round pulls them along."""
        return self.pending.ids()

    def sort_replies(self, replies: Iterable[Message]) -> tuple[reply_checks.Sorted, list[Lost]]:
        """This round's replies sorted (:func:`fedhm_flwr.server.replies.sort_replies`), each checked
        against what its node was sent, and the SuperLink's verdicts on earlier rounds' late nodes that
        came with them (its ``NODE_UNAVAILABLE`` answer to one of their messages: that node was lost in
        its round). Any other answer to such a message is a late arrival of this round. Every message
        answered or judged leaves the pending ones."""
        replies, earlier = list(replies), self.late_ids
        judged, _ = late_verdicts({mid: mid for mid in earlier}, replies)
        verdict_ids = {mid for mid, _ in judged}
        lost = self.pending.lost(judged)
        self.pending.resolve(m.metadata.reply_to_message_id for m in replies)
        rest = [m for m in replies if m.metadata.reply_to_message_id not in verdict_ids]
        return reply_checks.sort_replies(self.messages, rest, self.validate, earlier), lost

    def mark_late(self, server_round: int, late: list[int]) -> None:
        """The round stopped waiting for these nodes: their messages stay pending (an answer: a late
        arrival; the SuperLink's ``NODE_UNAVAILABLE``: the verdict on this round)."""
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self.messages}
        self.pending.add(server_round, {mid: node_id for mid, node_id in sent.items() if node_id in late})

    def settle_late(self, grid: Grid) -> list[Lost]:
        """After the last round: the SuperLink's verdicts on the nodes still late, pulling their messages
        for at most :attr:`verdict_wait` s (:func:`~fedhm_flwr.server.transport.settle_late`; one pull when
        0). An answer that comes now is no round's: it is dropped. Every message settled leaves the pending."""
        if not self.pending.messages:
            return []
        judged, answered = settle_late(grid, {mid: mid for mid in self.late_ids}, self.verdict_wait)
        lost = self.pending.lost(judged)
        self.pending.resolve(m.metadata.reply_to_message_id for m in answered)
        return lost

    def validate(self, node_id: int, msg: Message) -> tuple[Reply | None, str]:
        """Check a reply against what was sent to that node (:func:`fedhm_flwr.server.replies.check_train_reply`)."""
        if node_id not in self.sent:
            return None, "reply from a node that was not sent a task this round"
        index, payload = self.sent[node_id]
        info = self.known.nodes.get(node_id)
        checked, why = reply_checks.check_train_reply(
            msg.content,
            payload,
            self.levels[index],
            int(self.method.spec["num_classes"]),
            self.wire_dtype,
            self.untrusted.screen,
            info.examples if info is not None else None,
            self._examples_cap,
        )
        if checked is None:
            return None, why
        state, n, counts, scalars = checked
        return Reply(
            node_id, index, self.levels[index], state, n, counts, scalars, label=self.known.label(node_id), sent=payload
        ), ""

    def is_attacker(self, node_id: int) -> bool:
        return self.attacks.is_attacker(self.known.nodes.get(node_id), self.known.key(node_id), node_id)
