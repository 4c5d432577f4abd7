"""The shared heterogeneous round on Flower's Message API: one Strategy, whatever the method.

One round, one path, for every method: sample nodes, give each node its level, ask the method
for each level's (or node's) model, send one fresh message per node, validate the replies, let the
method merge them (through the defences and DP, :class:`fedhm_flwr.server.untrusted.Untrusted`, which wrap
the merge as Flower's DP strategies wrap a strategy), evaluate the global model and each level's
deployable model, and hand the round to the run's outputs (the ServerApp's :mod:`~fedhm_flwr.server.outputs`:
rows, checkpoints, the best model, the deployment statistics; the strategy writes nothing). The method
(:class:`fedhm_flwr.server.methods.method.Method`, ``strategy.method``) is Flower-free and says only how a
client's model is cut out of the global model and how replies are folded back in. The strategy holds
only the round's order; its collaborators are handed what they need and never reach back into it:
the nodes known (:mod:`~fedhm_flwr.server.known_nodes`), learnt and asked
(:mod:`~fedhm_flwr.server.nodes`), sampled (:mod:`~fedhm_flwr.server.sampling`) and given their
levels (:mod:`~fedhm_flwr.server.node_levels`, costs as data), the wire (each node's payload, the
check of its reply, what was sent: :class:`~fedhm_flwr.server.round_wire.RoundWire`), the replies
(:mod:`~fedhm_flwr.server.replies`: untrusted input), the evaluation
(:mod:`~fedhm_flwr.server.evaluation`) and the records (:mod:`~fedhm_flwr.server.report`).

A strategy runs one method (``method=...``) or a method's binding (:data:`strategies.STRATEGIES`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.app.typing import MetricRecordValues
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core.protocol import NodeInfo
from fedhm_flwr.math import levels as lv
from fedhm_flwr.server import evaluation as ev, replies as reply_checks
from fedhm_flwr.server.known_nodes import KnownNodes
from fedhm_flwr.server.late import Lost, amend_row, verdict_line
from fedhm_flwr.server.methods.method import Method, Reply, State
from fedhm_flwr.server.node_levels import LevelAssignment
from fedhm_flwr.server.nodes import NodeDiscovery
from fedhm_flwr.server.outputs import RoundEnd, RoundOutputs
from fedhm_flwr.server.payloads import Payload
from fedhm_flwr.server.report import RoundLog, progress_line, round_row, train_metrics
from fedhm_flwr.server.round_wire import RoundWire
from fedhm_flwr.server.sampling import RoundSampler
from fedhm_flwr.server.simulated_attacks import Attacks
from fedhm_flwr.server.transport import NODE_UNAVAILABLE, collect, content_bytes, exchange, push, wire_config
from fedhm_flwr.server.untrusted import Untrusted

__all__ = ["HeteroStrategy", "Payload", "Reply", "RoundLog", "State", "content_bytes", "progress_line"]


class HeteroStrategy(Strategy):
    """The round of every method (see the module docstring)."""

    #: the method a binding runs (``FedHMStrategy.method_class = FedHM``)
    method_class: Callable[[RunOptions, dict[str, Any]], Method] | None = None

    def __init__(
        self,
        opts: RunOptions,
        model_spec: dict[str, Any],
        evaluate_fn: Callable[..., dict[str, float]] | None = None,
        outputs: RoundOutputs | None = None,
        method: Method | None = None,
    ) -> None:
        if method is None:
            assert self.method_class is not None, "HeteroStrategy needs a method (or use a method's binding)"
            method = self.method_class(opts, model_spec)
        self.method = method
        self.opts = opts = method.opts  # the options as the method runs them (FedAvg: its family's, one level)
        self.evaluate_fn = evaluate_fn
        self.outputs = outputs  # what the run keeps of each round (the ServerApp's: rows, checkpoints)
        self.known = KnownNodes()
        self.assignment = LevelAssignment(opts, method.levels, method.costs, self.known)
        self.sampler = RoundSampler(opts, self.known)
        self.discovery = NodeDiscovery(opts, self.known, self.assignment, self.sampler)
        self.startup_info: dict[str, Any] = {}  # what the start-up before round 1 took (NodeDiscovery.startup)
        self.global_state: State | None = None
        self.round_log = RoundLog()
        self.history: list[dict[str, Any]] = []
        self.start_round = 1
        self._grid: Grid | None = None
        self._federated: ev.FederatedEvaluation | None = None  # this round's client-side evaluation
        self.federated_row: dict[str, Any] = {}
        self._bn: ev.BnUse | None = None  # the last server evaluation's norm statistics (federated sums)
        self.attacks = Attacks(opts)  # failures.attack: which nodes attack
        self.untrusted = Untrusted(method, self.history)  # the merge, defended / private (aggregation, dp)
        self.wire = RoundWire(opts, method, self.known, self.attacks, self.untrusted)  # payloads out, replies checked

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def levels(self) -> list[float]:
        return self.method.levels

    # ------------------------------------------------------------------ Flower's Strategy API

    def summary(self) -> None:
        log(
            INFO,
            "\t├──> Method: %s, levels %s, proportions %s, %s assignment",
            self.name,
            self.levels,
            self.opts.levels.shares,
            self.opts.levels.assignment,
        )
        log(
            INFO,
            "\t└──> Sampling: fraction %.2f (min %d), seed %d",
            self.opts.fraction_train,
            self.opts.min_train_nodes,
            self.opts.seed,
        )
        for level, fmt, args in self.method.summary_lines():
            log(level, fmt, *args)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        t0 = time.perf_counter()
        self.round_log = RoundLog()
        self._grid = grid
        self.global_state = self.wire.state_of(arrays)
        found = self.discovery
        self.round_log.query_bytes = found.refresh(grid, server_round)
        node_ids, moved = found.query_sampled(grid, server_round, self.sampler.sample(server_round))
        self.round_log.query_bytes += moved
        self.round_log.query_seconds = found.query_seconds
        self.round_log.queried = found.queried
        self.round_log.excluded = {self.node_label(n): why for n, why in sorted(found.excluded.items())}
        assigned = self.assignment.assign(server_round, node_ids)
        self.method.begin_round(server_round, self.global_state)
        injected = self.attacks.injected_failures(server_round, self.known.by_key(node_ids))
        self.untrusted.begin_round()
        attackers = {n for n in node_ids if self.wire.is_attacker(n)}
        self.attacks.begin_round([self.node_label(n) for n in self.known.by_key(list(attackers))])
        levels = {n: assigned[n] for n in node_ids}
        messages = self.wire.train_messages(
            server_round, levels, self.global_state, injected, attackers, self.round_log
        )
        self.round_log.sampled = len(messages)
        self.round_log.level_counts = lv.describe_assignment(levels, self.levels)
        self.round_log.assignments = {self.node_label(n): self.levels[index] for n, index in levels.items()}
        self.round_log.server_seconds += time.perf_counter() - t0
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        t0 = time.perf_counter()
        rl = self.round_log
        got, lost = self.wire.sort_replies(replies)
        rl.received_bytes += got.received_bytes
        rl.failures += got.failures
        rl.rejected += got.rejected
        rl.late_arrivals = got.late
        for node_id, why in got.failures:
            log(WARNING, "round %d: node %s failed: %s", server_round, self.node_label(node_id), why)
            if why == NODE_UNAVAILABLE:  # the SuperLink knows it is gone: it is asked again when back
                self.known.forget(node_id, server_round, why)
        for node_id, why in got.rejected:
            log(WARNING, "round %d: reply of node %s rejected: %s", server_round, self.node_label(node_id), why)
        valid = sorted(got.valid, key=lambda r: self.known.key(r.node_id))  # arrival order must not matter
        rl.late = sorted(set(self.wire.sent) - got.answered, key=self.known.key)
        self.wire.mark_late(server_round, rl.late)
        self.amend(lost, server_round, alive={n for n in got.answered if n not in dict(got.failures)})
        for node_id in rl.late:
            log(
                WARNING,
                "round %d: node %s sent no reply before the round's deadline (late)",
                server_round,
                self.node_label(node_id),
            )
        rl.assignments = {self.node_label(r.node_id): r.level for r in valid}  # those that trained
        metrics = train_metrics(valid)
        if not valid and not self.untrusted.merges_empty:  # DP: a round without replies still adds noise
            log(WARNING, "round %d: no valid reply; the global model stays as it was", server_round)
            rl.server_seconds += time.perf_counter() - t0
            return None, MetricRecord(_metric_values(metrics))
        assert self.global_state is not None
        new_state = self.untrusted.guarded_merge(server_round, self.global_state, valid)  # the method's, wrapped
        if self.untrusted.rejected:  # (refused in the merge: their figures go too)
            rl.rejected += self.untrusted.rejected
            metrics = train_metrics([r for r in valid if r.node_id not in {n for n, _ in self.untrusted.rejected}])
        self.global_state = new_state
        rl.server_seconds += time.perf_counter() - t0
        return self.wire.global_record(new_state), MetricRecord(_metric_values(metrics))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation (``evaluation.where`` clients or both): the nodes sampled for
        training this round evaluate the global model at their own level."""
        if self.opts.evaluation.where == "server":
            self._federated = None
            return []
        self._federated = ev.FederatedEvaluation(
            self._view(),
            server_round,
            self.wire.state_of(arrays),
            {n: index for n, (index, _) in self.wire.sent.items()},
        )
        return self._federated.messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The federated figures (the whole row entries stay in ``self.federated_row``)."""
        if self._federated is None:
            return None
        self.federated_row = self._federated.collect(replies)
        return MetricRecord(_metric_values(ev.numeric(self.federated_row, ("fed_",))))

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
        and/or by the sampled clients (``evaluation.where``). As in Flower's ``Strategy.start``, an
        ``evaluate_fn`` is called before the first round and after each round; its metrics join the
        round's row and ``evaluate_metrics_serverapp``."""
        self.summary()
        result = Result()
        self.startup_info = {
            "startup_started_at": time.time(),  # the set-up done: the node-info queries start (#53)
            **self.discovery.startup(grid, self.start_round),  # before the first round's clock
            "startup_marks": self.discovery.marks,  # the first nodes' marks (#53)
            "rounds_started_at": time.time(),
        }  # wall clock: the bench's whole-job figure (8)
        result.arrays = arrays = initial_arrays
        if evaluate_fn is not None and (first := evaluate_fn(self.start_round - 1, arrays)) is not None:
            result.evaluate_metrics_serverapp[self.start_round - 1] = first
        end: RoundEnd | None = None
        for server_round in range(self.start_round, num_rounds + 1):
            t_round = time.perf_counter()
            messages = list(self.configure_train(server_round, arrays, train_config or ConfigRecord(), grid))
            t_push, pushed = time.perf_counter(), push(grid, messages)
            if server_round < num_rounds:  # the next round's new nodes answer behind this round's training
                self.discovery.prefetch(grid, server_round + 1)
            # the answers to queries asked ahead are pulled as they come (kept unread for their round)
            arrivals: dict[str, float] = {}
            replies = (
                self.discovery.ahead.take(
                    collect(
                        grid,
                        pushed,
                        reply_checks.round_deadline(self.opts, timeout),
                        max_poll=0.5,
                        arrivals=arrivals,
                        also=[*self.discovery.ahead.ids(), *self.wire.late_ids],
                    )
                )
                if pushed
                else []
            )
            self.round_log.train_seconds = time.perf_counter() - t_push  # push to the last reply pulled
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            self.round_log.arrivals = sorted(arrivals.values())
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            row = self._round_row(server_round, train_metrics)
            end = self._round_end(server_round, num_rounds, arrays)
            if self.outputs is not None:
                self.outputs.trained(end)
            if self._evaluation_due(server_round, num_rounds):
                t_eval = time.perf_counter()
                if self.opts.evaluation.where != "clients":
                    row.update(self.evaluate_levels(self.wire.state_of(arrays)))
                    row.setdefault("bn_stats", self.opts.evaluation.bn_stats)
                    result.evaluate_metrics_serverapp[server_round] = MetricRecord(
                        _metric_values(ev.numeric(row, ("acc", "loss")))
                    )
                messages = list(self.configure_evaluate(server_round, arrays, evaluate_config or ConfigRecord(), grid))
                if messages:
                    replies = exchange(grid, messages, reply_checks.round_deadline(self.opts, timeout), max_poll=0.5)
                    # messages went out, so federated evaluation is on and its figures are a record
                    figures = cast(MetricRecord, self.aggregate_evaluate(server_round, replies))
                    result.evaluate_metrics_clientapp[server_round] = figures
                    row.update(self.federated_row)
                row["eval_seconds"] = time.perf_counter() - t_eval
            if evaluate_fn is not None:
                given = evaluate_fn(server_round, arrays)
                if given is not None:
                    row.update(dict(given))
                    result.evaluate_metrics_serverapp[server_round] = MetricRecord(
                        {**dict(result.evaluate_metrics_serverapp.get(server_round, {})), **dict(given)}
                    )
            if self.outputs is not None:
                end.known = self._bn.sums if self._bn is not None else None  # (the final evaluation's)
                self.outputs.evaluated(end, row)
            row["seconds"] = time.perf_counter() - t_round
            self.history.append(row)
            log(INFO, "%s", progress_line(row, num_rounds, self.levels))
            if self.outputs is not None:
                self.outputs.closed(end, row)
        lost = self.wire.settle_late(grid)  # late after the last round: lost? (verdict_wait on devices)
        self.amend(lost, None)
        if lost and end is not None and self.outputs is not None:
            self.outputs.settled(end)  # the last checkpoint again, its history amended too
        return result

    def amend(self, lost: list[Lost], server_round: int | None, alive: Iterable[int] = ()) -> None:
        """The SuperLink's verdicts on nodes earlier rounds recorded late (:mod:`~fedhm_flwr.server.late`),
        pulled in round ``server_round`` (None: after the last round): each such round's row is amended, in
        the history and in the run's outputs, and the node is forgotten (asked again when back) unless it
        answered this round (``alive``: back already, under the same node id)."""
        when, back = f"round {server_round}" if server_round is not None else "the run's end", set(alive)
        for verdict in lost:
            label = self.node_label(verdict.node_id)
            log(WARNING, "%s", verdict_line(when, label, verdict))
            if verdict.node_id not in back:
                self.known.forget(verdict.node_id, server_round or len(self.history), verdict.why)
            for row in (r for r in self.history if r.get("round") == verdict.server_round):
                amend_row(row, label, verdict.why, server_round)
                if self.outputs is not None:
                    self.outputs.amended(verdict.server_round, row)

    def _round_end(self, server_round: int, num_rounds: int, arrays: ArrayRecord) -> RoundEnd:
        """What the run's outputs are handed of this round (never the strategy itself)."""
        state = self.wire.state_of(arrays)
        return RoundEnd(server_round, num_rounds, state, self._view(), lambda: self.checkpoint_state(server_round))

    def _round_row(self, server_round: int, metrics: MetricRecord | None) -> dict[str, Any]:
        return round_row(
            server_round,
            self.wire.lr(server_round),
            self.round_log,
            cast("Mapping[str, float] | None", metrics),  # the record aggregate_train made of train_metrics' floats
            {**self.attacks.columns, **self.untrusted.columns},
            self.node_label,
        )

    # ------------------------------------------------------------------ evaluation (fedhm_flwr/server/evaluation.py)

    def _view(self) -> ev.RoundView:
        """What the evaluation is given of this round (never the strategy itself)."""
        return ev.RoundView(
            self.opts,
            self.method,
            self.evaluate_fn,
            self._grid,
            self.known,
            self.wire.wire_arrays,
            wire_config(self.wire.wire_dtype),
            len(self.history) + 1,
        )

    def evaluate_levels(self, global_state: State) -> dict[str, Any]:
        """Server test-set accuracy and loss of the global model and each level's deployable model."""
        self._bn = ev.BnUse("")  # the federated sums of this model version (reused by the deployment statistics)
        return ev.evaluate_levels(self._view(), global_state, self._bn)

    def _evaluation_due(self, server_round: int, num_rounds: int) -> bool:
        return server_round == num_rounds or server_round % self.opts.evaluation.every == 0

    def checkpoint_state(self, server_round: int) -> dict[str, Any]:
        return {
            "round": server_round,
            "history": self.history,
            "method": self.method.strategy_state(),
            "method_name": self.name,
            "nodes": self.assignment.state(),
        }

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue after the checkpoint's round (draws are derived from seed and round)."""
        self.start_round = int(checkpoint["round"]) + 1
        self.history[:] = list(checkpoint.get("history", []))  # the same list: the defences read it
        self.method.load_strategy_state(checkpoint.get("method", {}))
        self.assignment.load_state(checkpoint.get("nodes", {}))

    # ------------------------------------------------------------------ nodes and levels

    @property
    def nodes(self) -> dict[int, NodeInfo]:
        """The connected nodes the server knows (see :class:`fedhm_flwr.server.known_nodes.KnownNodes`)."""
        return self.known.nodes

    def node_label(self, node_id: int) -> str:
        """How outputs name a node: ``p<partition id>``, else its node-name, else ``n<node id>``."""
        return self.known.label(node_id)


def _metric_values(metrics: dict[str, float]) -> dict[str, MetricRecordValues]:
    """``metrics`` as MetricRecord's parameter type (flwr types it as an invariant dict; it only reads it)."""
    return cast("dict[str, MetricRecordValues]", metrics)
