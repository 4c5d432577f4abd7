"""The shared heterogeneous round on Flower's Message API.

One round, one path, for every method: sample nodes, give each node its level, ask the method
for each level's payload, send one fresh message per node, validate the replies, ask the method
to merge them, evaluate the global model and each level's deployable model, record, checkpoint.
A method (``strategies/<name>.py``) only says how a client's model is cut out of the global
model (:meth:`HeteroStrategy.level_payload`) and how replies are folded back in
(:meth:`HeteroStrategy.merge`).
"""

from __future__ import annotations

import json
import math
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log
from omegaconf import DictConfig

from fedhm_flwr import evaluation as ev
from fedhm_flwr import levels as lv
from fedhm_flwr import protocol as wire
from fedhm_flwr.protocol import ARRAYS, CONFIG, METRICS, NODE_UNAVAILABLE, asked_nodes, error_reason
from fedhm_flwr.aggregation import level_weights
from fedhm_flwr.config import data_spec, learning_rate, level_proportions
from fedhm_flwr.lowrank import recover_state
from fedhm_flwr.train import distill_options

from . import common
from .nodes import NodeInfo, NodeRegistry, collect, content_bytes, exchange, push
from .untrusted import Untrusted

State = dict[str, torch.Tensor]



@dataclass
class Payload:
    """One level's model for this round: its spec and its arrays (shared by its nodes)."""

    spec: dict[str, Any]
    arrays: dict[str, Any]  # name -> flwr Array (immutable, shared between fresh records)
    shapes: dict[str, tuple[int, ...]]
    train: dict[str, Any] = field(default_factory=dict)  # method-specific client options
    returned: tuple[str, ...] | None = None  # keys a reply must hold (None: the keys sent)


@dataclass
class Reply:
    """A validated training reply."""

    node_id: int
    level_index: int
    level: float
    state: State
    num_examples: int
    class_counts: np.ndarray
    metrics: dict[str, float]


@dataclass
class RoundLog:
    """Bookkeeping of one round (what becomes the round's output line)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    sampled: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)
    rejected: list[tuple[int, str]] = field(default_factory=list)
    level_counts: dict[str, int] = field(default_factory=dict)
    assignments: dict[str, float] = field(default_factory=dict)  # node (partition) -> level it trained
    excluded: dict[str, str] = field(default_factory=dict)  # connected node that sits out -> why
    server_seconds: float = 0.0
    query_bytes: int = 0  # node-info queries and their answers (new nodes only)
    query_seconds: float = 0.0  # wall time of those queries (part of server_seconds)
    queried: int = 0  # nodes asked for their node info this round


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

    def arrays(self, state: State, dtype: str = "float32") -> dict[str, Any]:
        out = {}
        for key, tensor in state.items():
            held = self._held.get((key, dtype))
            if held is None or not self._same(held[0], held[1], tensor):
                held = self._held[(key, dtype)] = (tensor, tensor._version, wire.wire_array(tensor, dtype))
                self.serialized[key] += 1
            out[key] = held[2]
        return out


class HeteroStrategy(Strategy):
    """Base of every method: the round; subclasses provide payloads and merging."""

    #: method name, as in ``method.name``
    name = "base"

    def __init__(
        self,
        cfg: DictConfig,
        model_spec: dict[str, Any],
        evaluate_fn: Callable[[dict[str, Any], State], dict[str, float]] | None = None,
        recorder: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.spec = dict(model_spec)
        self.levels: list[float] = [float(x) for x in cfg.levels.ratios]
        self.evaluate_fn = evaluate_fn
        self.recorder = recorder
        self.registry = NodeRegistry(cfg, self.levels, self.level_cost)
        self.startup_info: dict[str, Any] = {}  # what the start-up before round 1 took (NodeRegistry.startup)
        self.global_state: State | None = None
        self.sent: dict[int, tuple[int, Payload]] = {}  # node id -> (level index, payload) this round
        self._train_messages: list[Message] = []  # this round's training messages (their ids: who was asked)
        self.round_log = RoundLog()
        self.history: list[dict[str, Any]] = []
        self.start_round = 1
        self._grid: Grid | None = None
        self._federated: ev.FederatedEvaluation | None = None  # this round's client-side evaluation
        self.federated_row: dict[str, Any] = {}
        self._config_cache: dict[Any, Any] = {}  # task-config parts shared by a round's nodes, or by all rounds' (_train_config)
        self._bn: ev.BnUse | None = None  # the last server evaluation's norm statistics (federated sums)
        self.untrusted = Untrusted(self)  # attacks, defences, client-level DP (failures.attack, aggregation, dp)
        self.wire_dtype = str(cfg.get("wire", {}).get("dtype", "float32"))  # arrays both ways (wire.dtype)
        self.array_cache = ArrayCache()
        self._global_record: ArrayRecord | None = None  # the record last made of self.global_state

    # ------------------------------------------------------------------ method hooks

    def begin_round(self, server_round: int, global_state: State) -> None:
        """Work done once per round before any payload (FedHM: one SVD per layer)."""

    @abstractmethod
    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        """(model spec, arrays, method train options) of one level's client model."""

    @abstractmethod
    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        """Fold the validated replies back into a new global state."""

    def wire_arrays(self, state: State) -> dict[str, Any]:
        """A model the server sends (payload, evaluation), as Arrays in the wire dtype."""
        return self.array_cache.arrays(state, self.wire_dtype)

    def global_record(self, state: State) -> ArrayRecord:
        """The global state as the round's ArrayRecord (float32: the server keeps float32)."""
        self._global_record = wire.array_record(self.array_cache.arrays(state, "float32"))
        return self._global_record

    def state_of(self, arrays: ArrayRecord) -> State:
        """The state an ArrayRecord holds: the global state itself when the record was made of it
        (no second deserialisation), else the record's tensors in float32."""
        if arrays is self._global_record and self.global_state is not None:
            return self.global_state
        return arrays.to_torch_state_dict()

    def reply_keys(self, level_index: int, spec: dict[str, Any], state: State) -> list[str] | None:
        """Keys a client of this level sends back, when not all it received (e.g. only the trainable
        ones of a partly frozen model); None: the keys it received."""
        return None

    def initial_state(self, seed: int) -> State | None:
        """The initial global state when it is not the spec's seeded model (None: that model)."""
        return None

    def global_model(self, global_state: State) -> tuple[dict[str, Any], State]:
        """The model evaluated as ``global`` every round (default: the global state as it is)."""
        return self.spec, global_state

    def deployable(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State]:
        """The model a client of this level would deploy (evaluated every round)."""
        spec, state, _ = self.level_payload(level_index, global_state)
        return spec, state

    def recovered(self, reply: Reply) -> tuple[State, dict[str, torch.Tensor] | None]:
        """A reply as a full-shape model over the global state's keys, and its coverage (key ->
        boolean mask of the elements it holds; None: every element of every key it has). Robust
        aggregation and DP work on these (:mod:`strategies.untrusted`).

        Default (FedHM and every method whose replies are full-shape or hybrid low-rank): every
        factorized layer ``L.a.weight``/``L.b.weight`` recovered to ``L.weight = A·B`` at the rank
        the factors have, ``L.a.bias -> L.bias``; the reply covers everything it holds."""
        ranks = {key[:-len(".b.weight")]: int(reply.state[key[:-len(".b.weight")] + ".a.weight"].shape[1])
                 for key in reply.state if key.endswith(".b.weight")
                 and key[:-len(".b.weight")] + ".a.weight" in reply.state}
        return (recover_state(reply.state, ranks) if ranks else dict(reply.state)), None

    def reply_weights(self, replies: list[Reply]) -> np.ndarray | None:
        """The weight of each reply in the method's average over the clients covering an element
        (used by the clipping defence and DP). Default: FedHM's ``softmax(γ/τ)`` (times the sample
        counts with ``method.weight_by_samples``); None: the method's merge is not such an average."""
        method = self.cfg.method
        if method.get("tau") is None:
            return None
        counts = [r.num_examples for r in replies] if method.get("weight_by_samples") else None
        return level_weights([r.level for r in replies], float(method.tau), counts)

    def level_cost(self, level_index: int) -> dict[str, float]:
        """Costs of a level's client model (parameters, MACs, bytes, memory, ...), computed once per
        level, for budget-declared capabilities, ``inspect`` and the summary: the model
        :meth:`cost_spec` names, counted by :func:`strategies.common.level_costs` and refined by
        :meth:`extra_costs`. ``{}`` for a method that names no model."""
        cache = self.__dict__.setdefault("_level_costs", {})
        if level_index not in cache:
            cache[level_index] = common.level_costs(
                self.cost_spec(level_index), self.cfg, frozen_backbone=self.frozen_backbone,
                head_keys=getattr(self, "classifier_keys", []),
                extra=lambda model, costs: self.extra_costs(level_index, model, costs))
        return cache[level_index]

    #: the clients train part of a frozen model (the transformer track): costs count what they train
    frozen_backbone = False

    def cost_spec(self, level_index: int) -> dict[str, Any] | None:
        """The spec of the model a client of this level trains, whose costs are the level's (None: no costs)."""
        return None

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """A level's costs as reported, from the counted ones (``model``: the counted model)."""
        return costs

    def strategy_state(self) -> dict[str, Any]:
        """Method state beyond the global model that a checkpoint must keep."""
        return {}

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`strategy_state`."""

    # ------------------------------------------------------------------ Flower's Strategy API

    def summary(self) -> None:
        log(INFO, "\t├──> Method: %s, levels %s, proportions %s, %s assignment", self.name,
            self.levels, level_proportions(self.cfg), self.cfg.levels.assignment)
        log(INFO, "\t└──> Sampling: fraction %.2f (min %d), seed %d", self.cfg.fraction_train,
            self.cfg.min_train_nodes, self.cfg.seed)

    def node_payload(self, node_id: int, level_index: int, global_state: State,
                     level_payloads: dict[int, Payload]) -> Payload:
        """The payload sent to one node this round. Default: its level's payload, cut once per
        level per round and shared (``level_payloads`` is the round's cache, level index ->
        payload). A method that cuts a different model for every client (PriSM samples kernels
        per client) overrides this; ``self.sent`` then remembers what each node got."""
        if level_index not in level_payloads:
            spec, state, options = self.level_payload(level_index, global_state)
            returned = self.reply_keys(level_index, spec, state)
            level_payloads[level_index] = Payload(spec, self.wire_arrays(state),
                                                  {k: tuple(v.shape) for k, v in state.items()},
                                                  options, None if returned is None else tuple(returned))
        return level_payloads[level_index]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        t0 = time.perf_counter()
        self.round_log = RoundLog()
        self._grid = grid
        self.global_state = self.state_of(arrays)
        self.round_log.query_bytes = self.registry.refresh(grid, server_round)
        node_ids, moved = self.registry.query_sampled(grid, server_round, self.registry.sample(server_round))
        self.round_log.query_bytes += moved
        self.round_log.query_seconds = self.registry.query_seconds
        self.round_log.queried = self.registry.queried
        self.round_log.excluded = {self.node_label(n): why for n, why in sorted(self.registry.excluded.items())}
        assignment = self.registry.assign(server_round, node_ids)
        self.begin_round(server_round, self.global_state)
        injected = self._injected_failures(server_round, node_ids)
        self.untrusted.begin_round(node_ids)
        payloads: dict[int, Payload] = {}
        self.sent = {}
        messages = []
        for node_id in node_ids:
            index = assignment[node_id]
            payload = self.node_payload(node_id, index, self.global_state, payloads)
            record = wire.array_record(payload.arrays)  # fresh record, shared Arrays
            config = self._train_config(server_round, node_id, index, payload)
            if node_id in injected:
                config[wire.INJECT] = injected[node_id]
                config[wire.INJECT_SECONDS] = float(self.cfg.failures.slow_seconds)
            config.update(self.untrusted.train_config(node_id))
            content = RecordDict({ARRAYS: record, CONFIG: config})
            self.round_log.sent_bytes += content_bytes(content)
            self.sent[node_id] = (index, payload)
            messages.append(Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN))
        self.round_log.sampled = len(messages)
        self.round_log.level_counts = lv.describe_assignment({n: assignment[n] for n in node_ids}, self.levels)
        self.round_log.assignments = {self.node_label(n): self.levels[assignment[n]] for n in node_ids}
        self.round_log.server_seconds += time.perf_counter() - t0
        self._train_messages = messages
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        t0 = time.perf_counter()
        valid: list[Reply] = []
        for node_id, msg in asked_nodes(self._train_messages, list(replies)):  # keyed by the node asked
            if msg.has_content():  # every reply that arrived counts, rejected ones included
                self.round_log.received_bytes += content_bytes(msg.content)
            if msg.has_error():
                why = error_reason(msg)
                self.round_log.failures.append((node_id, why))
                log(WARNING, "round %d: node %s failed: %s", server_round, self.node_label(node_id),
                    why if why == NODE_UNAVAILABLE else msg.error.reason)
                if why == NODE_UNAVAILABLE:  # the SuperLink knows it is gone: it is asked again when back
                    self.registry.forget(node_id, server_round, why)
                continue
            reply, reason = self._validate(node_id, msg)
            if reply is None:
                self.round_log.rejected.append((node_id, reason))
                log(WARNING, "round %d: reply of node %d rejected: %s", server_round, node_id, reason)
                continue
            valid.append(reply)
        missing = set(self.sent) - {r.node_id for r in valid} - {n for n, _ in self.round_log.failures} - {
            n for n, _ in self.round_log.rejected}
        for node_id in sorted(missing):
            self.round_log.failures.append((node_id, "no reply before the round timeout"))
            log(WARNING, "round %d: node %s sent no reply (timeout)", server_round, self.node_label(node_id))
        self.round_log.assignments = {self.node_label(r.node_id): r.level for r in valid}  # those that trained
        metrics = self._train_metrics(valid)
        if not valid and not self.untrusted.merges_empty:  # DP: a round without replies still adds noise
            log(WARNING, "round %d: no valid reply; the global model stays as it was", server_round)
            self.round_log.server_seconds += time.perf_counter() - t0
            return None, MetricRecord(metrics)
        assert self.global_state is not None
        valid.sort(key=lambda r: self._partition_key(r.node_id))  # arrival order must not matter
        new_state = self.untrusted.merge(server_round, self.global_state, valid)  # self.merge unless defended
        self.global_state = new_state
        self.round_log.server_seconds += time.perf_counter() - t0
        return self.global_record(new_state), MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Federated evaluation (``evaluation.where`` clients or both): the nodes sampled for
        training this round evaluate the global model at their own level."""
        if self.cfg.evaluation.where == "server":
            self._federated = None
            return []
        self._federated = ev.FederatedEvaluation(self, server_round, self.state_of(arrays))
        return self._federated.messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The federated figures (the whole row entries stay in ``self.federated_row``)."""
        if self._federated is None:
            return None
        self.federated_row = self._federated.collect(replies)
        return MetricRecord(ev.numeric(self.federated_row, ("fed_",)))

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """The run: the same round for every method, evaluated on the server's test set per level
        and/or by the sampled clients (``evaluation.where``)."""
        self.summary()
        result = Result()
        self.startup_info = self.registry.startup(grid, self.start_round)  # before the first round's clock
        arrays = initial_arrays
        result.arrays = arrays
        for server_round in range(self.start_round, num_rounds + 1):
            t_round = time.perf_counter()
            messages = list(self.configure_train(server_round, arrays, train_config or ConfigRecord(), grid))
            pushed = push(grid, messages)
            if server_round < num_rounds:  # the next round's new nodes answer behind this round's training
                self.registry.prefetch(grid, server_round + 1)
            replies = collect(grid, pushed, timeout, max_poll=0.5) if pushed else []
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            row = self._round_row(server_round, train_metrics)
            if self._evaluation_due(server_round, num_rounds):
                t_eval = time.perf_counter()
                if self.cfg.evaluation.where != "clients":
                    row.update(self.evaluate_levels(self.state_of(arrays)))
                    row.setdefault("bn_stats", self.cfg.evaluation.bn_stats)
                    result.evaluate_metrics_serverapp[server_round] = MetricRecord(ev.numeric(row, ("acc", "loss")))
                messages = list(self.configure_evaluate(server_round, arrays, evaluate_config or ConfigRecord(), grid))
                if messages:
                    replies = exchange(grid, messages, timeout, max_poll=0.5)
                    result.evaluate_metrics_clientapp[server_round] = self.aggregate_evaluate(server_round, replies)
                    row.update(self.federated_row)
                row["eval_seconds"] = time.perf_counter() - t_eval
            if server_round == num_rounds and self.recorder is not None and self.cfg.evaluation.get("deploy_stats", True):
                self._save_deployment_statistics(server_round, self.state_of(arrays), row)
            row["seconds"] = time.perf_counter() - t_round
            self.history.append(row)
            log(INFO, "%s", progress_line(row, num_rounds, self.levels))
            if self.recorder is not None:
                self.recorder.log_round(row)
                if self._checkpoint_due(server_round, num_rounds):
                    self.recorder.save_checkpoint(self.state_of(arrays), self.checkpoint_state(server_round))
                if self.cfg.checkpoint.get("keep_best", False):
                    self.recorder.save_best(self.state_of(arrays), row)
        return result

    # ------------------------------------------------------------------ evaluation (fedhm_flwr/evaluation.py)

    def evaluate_levels(self, global_state: State) -> dict[str, Any]:
        """Server test-set accuracy and loss of the global model and each level's deployable model."""
        self._bn = ev.BnUse("")  # the federated sums of this model version (reused by the deployment statistics)
        return ev.evaluate_levels(self, global_state, self._bn)

    def _save_deployment_statistics(self, server_round: int, global_state: State, row: dict[str, Any]) -> None:
        """The fixed norm statistics of every level's deployable model (the clients' sBN sums),
        saved beside the final checkpoint for ``fedhm export`` (docs/METHODS.md#deployable-statistics)."""
        known = self._bn.sums if self._bn is not None else None  # the final round's evaluation asked already
        found = ev.deployment_statistics(self, global_state, known)
        if found is not None:
            tensors, metadata, nbytes = found
            self.recorder.save_bn_statistics(tensors, {**metadata, "round": str(server_round)})
            row["bytes_bn_stats"] = row.get("bytes_bn_stats", 0) + nbytes

    def _evaluation_due(self, server_round: int, num_rounds: int) -> bool:
        return server_round == num_rounds or server_round % int(self.cfg.evaluation.every) == 0

    def _checkpoint_due(self, server_round: int, num_rounds: int) -> bool:
        every = int(self.cfg.checkpoint.every)
        return server_round == num_rounds or (every > 0 and server_round % every == 0)

    def checkpoint_state(self, server_round: int) -> dict[str, Any]:
        return {"round": server_round, "history": self.history, "method": self.strategy_state(),
                "method_name": self.name, "nodes": self.registry.state()}

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue after the checkpoint's round (draws are derived from seed and round)."""
        self.start_round = int(checkpoint["round"]) + 1
        self.history = list(checkpoint.get("history", []))
        self.load_strategy_state(checkpoint.get("method", {}))
        self.registry.load_state(checkpoint.get("nodes", {}))

    # ------------------------------------------------------------------ nodes and levels

    @property
    def nodes(self) -> dict[int, NodeInfo]:
        """The connected nodes the server knows (see :class:`strategies.nodes.NodeRegistry`)."""
        return self.registry.nodes

    def node_label(self, node_id: int) -> str:
        """How outputs name a node: ``p<partition id>``, else its node-name, else ``n<node id>``."""
        return self.registry.label(node_id)

    def _partition_key(self, node_id: int) -> int:
        """The node's stable key (its partition id, or a hash of its name): orders replies,
        seeds its training, samples it."""
        return self.registry.key(node_id)

    # ------------------------------------------------------------------ messages

    def _injected_failures(self, server_round: int, node_ids: list[int]) -> dict[int, str]:
        """Seeded failure injection: node -> 'crash' or 'slow' for this round."""
        fail = self.cfg.failures
        if not (fail.crash_probability or fail.slow_probability):
            return {}
        rng = lv.round_rng(int(self.cfg.seed), server_round, stream=2)
        out = {}
        for node_id in sorted(node_ids, key=self._partition_key):
            crash, slow = rng.random(), rng.random()
            if crash < float(fail.crash_probability):
                out[node_id] = "crash"
            elif slow < float(fail.slow_probability):
                out[node_id] = "slow"
        return out

    def _train_config(self, server_round: int, node_id: int, index: int, payload: Payload) -> ConfigRecord:
        cfg = self.cfg
        info = self.nodes[node_id]
        # what every node of the round (of a payload, of a partition count) is told alike, built once
        cache = self._config_cache
        if cache.get("round") != server_round:  # the run's parts (data specs, fixed train options) stay
            kept = {k: v for k, v in cache.items() if isinstance(k, tuple) and k[0] in ("data", "fixed")}
            cache.clear()
            cache.update(kept, round=server_round, lr=learning_rate(cfg, server_round), seed=int(cfg.seed))
        if ("train", id(payload)) not in cache:
            cache[("train", id(payload))] = (payload, self._train_json(server_round, payload))
        if ("data", info.num_partitions) not in cache:
            cache[("data", info.num_partitions)] = json.dumps(data_spec(cfg, info.num_partitions))
        return ConfigRecord({
            wire.SERVER_ROUND: server_round,
            wire.METHOD: self.name,
            wire.LEVEL: self.levels[index],
            wire.LEVEL_INDEX: index,
            wire.MODEL_SPEC: cache[("train", id(payload))][1][0],
            wire.TRAIN: cache[("train", id(payload))][1][1],
            wire.DATA_SPEC: cache[("data", info.num_partitions)],
            wire.SEED: lv.client_seed(cache["seed"], server_round, self._partition_key(node_id)),
            **self.wire_config(),
        })

    def _train_json(self, server_round: int, payload: Payload) -> tuple[str, str]:
        """(model spec, train options) of a payload this round, as the task config's JSON strings."""
        cfg, cache = self.cfg, self._config_cache
        if ("fixed",) not in cache:  # the same every round (read once: a config lookup costs microseconds)
            cache[("fixed",)] = {
                "local_epochs": int(cfg.train.local_epochs),
                "batch_size": int(cfg.train.batch_size),
                "momentum": float(cfg.train.momentum),
                "weight_decay": float(cfg.train.weight_decay),
                "masked_ce": bool(cfg.train.masked_ce),
                "grad_clip": float(cfg.train.grad_clip),
                "threads": max(1, int(math.floor(float(cfg.simulation.num_cpus)))),
                **distill_options(cfg.train.get("distill")),
            }
        lr = cache["lr"] if cache.get("round") == server_round else learning_rate(cfg, server_round)
        train = {"lr": lr, **cache[("fixed",)], **payload.train}
        return json.dumps(payload.spec), json.dumps(train)

    def wire_config(self) -> dict[str, str]:
        """The task-config entry telling a node the wire dtype (absent at the default float32)."""
        return {} if self.wire_dtype == "float32" else {wire.WIRE_DTYPE: self.wire_dtype}

    def _validate(self, node_id: int, msg: Message) -> tuple[Reply | None, str]:
        """Check a reply against what was sent to that node; (None, reason) when malformed."""
        if node_id not in self.sent:
            return None, "reply from a node that was not sent a task this round"
        index, payload = self.sent[node_id]
        content = msg.content
        if ARRAYS not in content or METRICS not in content:
            return None, f"reply lacks '{ARRAYS}' or '{METRICS}'"
        record = content[ARRAYS]
        expected, got = set(payload.returned if payload.returned is not None else payload.shapes), set(record.keys())
        if expected != got:
            missing, extra = sorted(expected - got), sorted(got - expected)
            return None, f"keys do not match level {self.levels[index]:g}: missing {missing[:3]}, unexpected {extra[:3]}"
        for key, array in record.items():  # shapes before any tensor is read
            if tuple(array.shape) != payload.shapes[key]:
                return None, f"{key} has shape {tuple(array.shape)}, level {self.levels[index]:g} needs {payload.shapes[key]}"
        state = wire.from_wire(wire.record_tensors(record), self.wire_dtype)  # back to float32
        too_big = self.untrusted.screen(state)  # NaN/inf, or a tensor above aggregation.max_norm
        if too_big:
            return None, too_big
        metrics = content[METRICS]
        n = metrics.get(wire.NUM_EXAMPLES)
        if not isinstance(n, (int, float)) or isinstance(n, bool) or not n > 0:
            return None, f"num-examples missing or not positive ({n!r})"
        counts = np.asarray(metrics.get(wire.CLASS_COUNTS, []), dtype=np.int64)
        num_classes = int(self.spec["num_classes"])
        if counts.shape != (num_classes,) or np.any(counts < 0):
            return None, f"class-counts must hold {num_classes} non-negative counts"
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return Reply(node_id, index, self.levels[index], state, int(n), counts, scalars), ""

    def _train_metrics(self, valid: list[Reply]) -> dict[str, float]:
        out: dict[str, float] = {"replies": float(len(valid))}
        if valid:
            n = np.array([r.num_examples for r in valid], dtype=np.float64)
            for key in (wire.TRAIN_LOSS, wire.TRAIN_ACCURACY):
                vals = [r.metrics.get(key, math.nan) for r in valid]
                out[key] = float(np.dot(n, vals) / n.sum())
            out["client-seconds-max"] = max(r.metrics.get(wire.SECONDS, 0.0) for r in valid)
            ray_nodes = {r.metrics[wire.RAY_NODE] for r in valid if wire.RAY_NODE in r.metrics}
            if ray_nodes:  # Ray simulation: on how many Ray nodes this round's clients trained
                out["ray-nodes"] = float(len(ray_nodes))
        return out

    def _round_row(self, server_round: int, train_metrics: MetricRecord | None) -> dict[str, Any]:
        log_ = self.round_log
        row: dict[str, Any] = {
            "round": server_round,
            "lr": learning_rate(self.cfg, server_round),
            "sampled": log_.sampled,
            "replies": int(train_metrics["replies"]) if train_metrics is not None else 0,
            "failures": len(log_.failures),
            "rejected": len(log_.rejected),
            "bytes_sent": log_.sent_bytes,
            "bytes_received": log_.received_bytes,
            "bytes_queries": log_.query_bytes,
            "server_seconds": log_.server_seconds,
            "query_seconds": log_.query_seconds,
            "queried": log_.queried,
        }
        if train_metrics is not None:
            for key in ("train-loss", "train-accuracy", "client-seconds-max"):
                if key in train_metrics:
                    row[key.replace("-", "_")] = float(train_metrics[key])
            if "ray-nodes" in train_metrics:
                row["ray_nodes"] = int(train_metrics["ray-nodes"])
        for level, count in log_.level_counts.items():
            row[f"clients/level_{level}"] = count
        row["assignments"] = json.dumps(log_.assignments, sort_keys=True)
        if log_.excluded:
            row["excluded"] = json.dumps(log_.excluded, sort_keys=True)
        row.update(self.untrusted.columns)
        if log_.failures or log_.rejected:
            row["failure_reasons"] = json.dumps(
                [[self.node_label(n), why] for n, why in log_.failures + log_.rejected])
        return row


def progress_line(row: dict[str, Any], num_rounds: int, levels: list[float]) -> str:
    """The one console line of a round."""
    parts = [f"[round {row['round']}/{num_rounds}]"]
    if "acc/global" in row:
        parts.append(f"global acc {row['acc/global']:.4f} loss {row['loss/global']:.4f}")
        per_level = [f"{lvl:g}:{row[f'acc/level_{lvl:g}']:.3f}" for lvl in levels if f"acc/level_{lvl:g}" in row]
        if per_level:
            parts.append("levels " + " ".join(per_level))
    if "fed_acc/all" in row:
        parts.append(f"clients acc {row['fed_acc/all']:.4f} (worst10 {row['fed_acc_clients/worst10']:.3f}, "
                     f"{row['fed_clients']} clients)")
    if "train_loss" in row:
        parts.append(f"train loss {row['train_loss']:.4f}")
    parts.append(f"replies {row['replies']}/{row['sampled']}")
    if row["failures"] or row["rejected"]:
        parts.append(f"failures {row['failures']} rejected {row['rejected']}")
    parts.append(f"sent {row['bytes_sent'] / 1e6:.2f}MB recv {row['bytes_received'] / 1e6:.2f}MB")
    parts.append(f"{row.get('seconds', 0.0):.1f}s")
    return " | ".join(parts)
