"""Evaluation: the server's test set, federated (client-side) evaluation and sBN statistics.

Three parts, each called by the shared round (``fedhm_flwr/server/strategy.py``) on evaluation rounds, which
hands them what they need as a :class:`RoundView` (the grid, the node registry, the method's models),
never the strategy itself:

* **Server test set** (``evaluation.where`` = ``server`` or ``both``): :func:`make_evaluator`
  scores a model on the server's test set; :func:`evaluate_levels` scores the global model and
  each level's deployable model. Keys ``acc/global``, ``loss/global``, ``acc/level_<γ>``,
  ``loss/level_<γ>``. With ``evaluation.bn_stats=federated`` the norm statistics come from the
  clients (:func:`federated_bn_sums`: every model evaluated in one message per node, as are all
  levels' deployment statistics); when no client answers, test-batch statistics are used
  and the row's ``bn_stats`` says so (``test_batch_fallback``).
* **Federated** (``clients`` or ``both``): :class:`FederatedEvaluation` sends the nodes sampled
  for training this round an EVALUATE message with the global model at their own level, and
  :func:`federated_figures` turns the replies into ``fed_acc/all``, ``fed_loss/all``,
  ``fed_acc/level_<γ>``, ``fed_loss/level_<γ>``, ``fed_clients/level_<γ>``, ``fed_clients`` and
  the spread over clients ``fed_acc_clients/mean|std|worst10`` (:func:`client_spread`).
* The pure statistics (:func:`weighted_mean`, :func:`client_spread`, :func:`federated_figures`)
  import no Flower.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore import log
from torch.utils.data import DataLoader

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core import protocol as wire
from fedhm_flwr.core.protocol import ARRAYS, CONFIG, METRICS, read_eval
from fedhm_flwr.data import test_dataset
from fedhm_flwr.data.tensors import ImageTensorDataset
from fedhm_flwr.math.bn_stats import norm_layers
from fedhm_flwr.math.train import evaluate, evaluate_batches
from fedhm_flwr.models import build_model, deployable_network, shape_device
from fedhm_flwr.models.batched import Traces, merge_networks
from fedhm_flwr.server.bn_query import federated_bn_sums, spec_key
from fedhm_flwr.server.transport import NODE_UNAVAILABLE, asked_nodes, content_bytes, error_reason

State = dict[str, torch.Tensor]
WORST_FRACTION = 0.1  # fed_acc_clients/worst10: the mean accuracy of the worst ceil(10 %) clients


# ---------------------------------------------------------------------- pure statistics


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """sum(w * v) / sum(w); NaN when there is no weight."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or w.sum() <= 0:
        return math.nan
    return float(np.dot(w, np.asarray(values, dtype=np.float64)) / w.sum())


def client_spread(accuracies: Sequence[float], worst_fraction: float = WORST_FRACTION) -> dict[str, float]:
    """The spread of the clients' accuracies, each client counting once (not by examples):
    ``mean``, ``std`` (population, ddof 0) and ``worst10``, the mean accuracy of the
    ``ceil(worst_fraction * n)`` clients with the lowest accuracy (at least one client)."""
    acc = np.sort(np.asarray(accuracies, dtype=np.float64))
    if acc.size == 0:
        return {}
    k = max(1, math.ceil(worst_fraction * acc.size - 1e-9))
    return {"mean": float(acc.mean()), "std": float(acc.std()), "worst10": float(acc[:k].mean())}


@dataclass(frozen=True)
class ClientScore:
    """One client's evaluation reply."""

    node: str  # the node's label (p<partition> or n<node id>)
    level: float
    num_examples: int
    loss: float
    accuracy: float


def federated_figures(scores: Sequence[ClientScore], levels: Sequence[float]) -> dict[str, float]:
    """The federated row entries of one evaluation round (see the module docstring)."""
    out: dict[str, float] = {"fed_clients": len(scores)}
    if not scores:
        return out
    n = [s.num_examples for s in scores]
    out["fed_acc/all"] = weighted_mean([s.accuracy for s in scores], n)
    out["fed_loss/all"] = weighted_mean([s.loss for s in scores], n)
    for level in levels:
        mine = [s for s in scores if s.level == float(level)]
        out[f"fed_clients/level_{level:g}"] = len(mine)
        if mine:
            w = [s.num_examples for s in mine]
            out[f"fed_acc/level_{level:g}"] = weighted_mean([s.accuracy for s in mine], w)
            out[f"fed_loss/level_{level:g}"] = weighted_mean([s.loss for s in mine], w)
    out.update({f"fed_acc_clients/{k}": v for k, v in client_spread([s.accuracy for s in scores]).items()})
    return out


# ---------------------------------------------------------------------- the server's test set


def make_evaluator(opts: RunOptions, device: torch.device) -> TestSetScorer:
    """Server-side evaluation on the test set: (model spec, state[, sBN sums]) -> {accuracy, loss}."""
    return TestSetScorer(
        test_dataset(opts.data_spec(), data_dir=opts.dataset.data_dir), opts.evaluation.batch_size, device
    )


class TestSetScorer:
    """Scores models on the server's test set: one (:meth:`__call__`), or several in one pass over it
    (:meth:`many`: the networks run as one, their equal prefix computed once, ``fedhm_flwr.models.batched``,
    over the test set's batches cut once per run, :attr:`batches`, each level's network traced once per run)."""

    def __init__(self, test: Any, batch_size: int, device: torch.device) -> None:
        self.test, self.batch_size, self.device = test, batch_size, device
        self.traces = Traces()  # the levels' graphs, traced in the first round and reused

    def __call__(
        self, spec: dict[str, Any], state: State, bn_sums: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float]:
        # with federated sBN sums: fixed statistics, as the exported model carries; else test-batch statistics
        return evaluate(deployable_network(spec, state, bn_sums)[1], self.test, self.batch_size, self.device)

    @functools.cached_property
    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batches a DataLoader over the test set gives (the same tensors, bit for bit), cut once:
        an in-memory image set without a transform as views of its tensors (no copy), any other set
        as the DataLoader's batches (held for the run)."""
        test, size = self.test, self.batch_size
        if (
            isinstance(test, ImageTensorDataset)
            and test.transform is None
            and test.images.is_contiguous()
            and test.labels.is_contiguous()
        ):
            return [(test.images[i : i + size], test.labels[i : i + size]) for i in range(0, len(test), size)]
        return list(DataLoader(test, batch_size=size, shuffle=False))

    def many(
        self, models: Sequence[tuple[dict[str, Any], State, dict[str, torch.Tensor] | None]]
    ) -> list[dict[str, float]]:
        """Each model's figures, equal to :meth:`__call__`'s bit for bit (tested)."""
        networks = [deployable_network(spec, state, sums)[1].to(self.device).eval() for spec, state, sums in models]
        keys = [(spec_key(spec), sums is None) for spec, _, sums in models]  # what fixes a network's graph
        merged = merge_networks(networks, keys, self.traces) if networks else None
        if merged is None:
            return [evaluate_batches(n, self.batches, self.device, outputs=0)[0] for n in networks]
        return evaluate_batches(merged, self.batches, self.device, outputs=len(networks))


@dataclass
class RoundView:
    """What an evaluation round is given by the round: the run's options, the method (its ``levels``,
    ``global_model`` and ``deployable`` models), the server's test-set scorer, the grid and the node
    registry (``nodes``, ``key``, ``label``, ``forget``), how a model goes on the wire (``arrays``:
    its Arrays, serialised once; ``wire_config``: the task-config entry of the wire dtype) and the
    round's number (seeds the choice of the clients asked for norm statistics)."""

    opts: RunOptions
    method: Any
    evaluate_fn: Callable[..., dict[str, float]] | None
    grid: Any
    registry: Any
    arrays: Callable[[State], dict[str, Any]]
    wire_config: dict[str, str]
    server_round: int


@dataclass
class BnUse:
    """Which norm statistics one evaluation round used, what asking the clients cost, and the
    sums they gave per model (``spec_key``: reused by :class:`fedhm_flwr.server.deployment.DeploymentQuery`)."""

    configured: str
    fallbacks: int = 0
    bytes: int = 0
    sums: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bn_stats": "test_batch_fallback" if self.fallbacks else self.configured}
        if self.fallbacks:
            out["bn_fallbacks"] = self.fallbacks
        if self.bytes:
            out["bytes_bn_stats"] = self.bytes
        return out


@functools.lru_cache(maxsize=32)
def _tracks_running_statistics(spec_json: str) -> bool:
    spec = json.loads(spec_json)
    with shape_device(spec):
        return any(m.track_running_stats for m in norm_layers(build_model(spec, spectral_init=False)).values())


def statistics_label(configured: str, spec: dict[str, Any]) -> str:
    """What a model evaluated under ``evaluation.bn_stats=configured`` normalises with:
    ``running_averaged`` for a model whose norm layers keep running statistics (averaged over
    the clients as buffers; eval mode reads them, whatever the test batch), else ``configured``."""
    if configured == "test_batch" and not spec.get("trainable_only") and _tracks_running_statistics(spec_key(spec)):
        return "running_averaged"
    return configured


def distinct_models(
    method: Any, global_state: State, levels: bool = True
) -> tuple[list[tuple[dict[str, Any], State]], dict[str, int]]:
    """(models, keys): the global model, then (``levels``) each level's deployable model, a level
    whose model equals the global one (spec and every tensor) listed once; ``keys``: the row-key
    suffix (``global``, ``level_<γ>``) -> its index in ``models``."""
    global_spec, global_model = method.global_model(global_state)
    models: list[tuple[dict[str, Any], State]] = [(global_spec, global_model)]
    keys = {"global": 0}
    for index, level in enumerate(method.levels if levels else []):
        spec, state = method.deployable(index, global_state)
        same = (
            spec == global_spec
            and state.keys() == global_model.keys()
            and all(torch.equal(state[k], global_model[k]) for k in state)
        )
        if not same:
            models.append((spec, state))
        keys[f"level_{level:g}"] = 0 if same else len(models) - 1
    return models, keys


def evaluate_levels(view: RoundView, global_state: State, bn: BnUse | None = None) -> dict[str, Any]:
    """Test-set accuracy and loss of the global model and of each level's deployable model, with
    the row's ``bn_stats`` (and ``bytes_bn_stats``); ``bn`` collects the federated sums, asked for
    every model at once (one message per node)."""
    if view.evaluate_fn is None:
        return {}
    models, keys = distinct_models(view.method, global_state, view.opts.evaluation.levels)
    bn = bn if bn is not None else BnUse("")
    bn.configured = statistics_label(view.opts.evaluation.bn_stats, models[0][0])
    metrics = evaluate_models(view, models, bn)
    out: dict[str, Any] = {}
    for suffix, index in keys.items():
        out[f"acc/{suffix}"], out[f"loss/{suffix}"] = metrics[index]["accuracy"], metrics[index]["loss"]
    out.update(bn.row())
    return out


def evaluate_models(
    view: RoundView, models: Sequence[tuple[dict[str, Any], State]], bn: BnUse
) -> list[dict[str, float]]:
    """Evaluate each model; with federated sBN the norm statistics of all of them come from the
    clients in one query, a model none answered for uses its test batches (logged, counted in ``bn``)."""
    assert view.evaluate_fn is not None
    federated = [
        i
        for i, (spec, _) in enumerate(models)
        if view.opts.evaluation.bn_stats == "federated" and not spec.get("trainable_only")
    ]
    found: dict[int, dict[str, torch.Tensor] | None] = {}
    if federated:
        answers, nbytes = federated_bn_sums(view, [models[i] for i in federated])
        bn.bytes += nbytes
        found = dict(zip(federated, answers))
    chosen: list[tuple[dict[str, Any], State, dict[str, torch.Tensor] | None]] = []
    for i, (spec, state) in enumerate(models):
        sums = found.get(i)
        if i in found and sums is None:
            bn.fallbacks += 1
            log(WARNING, "bn-stats: no client answered; this model is evaluated with test-batch statistics")
        elif sums is not None:
            bn.sums[spec_key(spec)] = sums
        chosen.append((spec, state, sums))
    return score_all(view.evaluate_fn, chosen)


def score_all(
    evaluate_fn: Callable[..., dict[str, float]],
    models: Sequence[tuple[dict[str, Any], State, dict[str, torch.Tensor] | None]],
) -> list[dict[str, float]]:
    """Each (spec, state, sBN sums or None)'s figures: in one pass over the test set when the scorer can
    (:meth:`TestSetScorer.many`), else model by model."""
    many = getattr(evaluate_fn, "many", None)
    if many is not None:
        return list(many(models))
    return [evaluate_fn(*model) if model[2] is not None else evaluate_fn(*model[:2]) for model in models]


# ---------------------------------------------------------------------- federated evaluation


class FederatedEvaluation:
    """One round's client-side evaluation: the EVALUATE messages to the nodes sampled for
    training (each at its own level, one model cut per level and shared), then the figures of
    the replies (:meth:`collect`). Failures and timeouts are counted, logged, never fatal."""

    def __init__(self, view: RoundView, server_round: int, global_state: State, sent: dict[int, int]) -> None:
        """``sent``: node id -> level index of the nodes sent a training task this round."""
        self.registry = view.registry
        self.levels = view.method.levels
        self.server_round = server_round
        self.level_of: dict[int, int] = {}  # node id -> level index
        self.bytes_sent = 0
        self.messages: list[Message] = []
        opts, nodes = view.opts, view.registry.nodes
        models: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # level index -> (spec, arrays)
        sent = {n: v for n, v in sent.items() if n in nodes}  # not those found gone
        for node_id, index in sorted(sent.items(), key=lambda kv: view.registry.key(kv[0])):
            if index not in models:
                spec, state = view.method.deployable(index, global_state)
                models[index] = (spec, view.arrays(state))
            spec, arrays = models[index]
            record = ArrayRecord.from_array_dict(arrays)  # fresh record, shared bytes
            config = ConfigRecord(
                {
                    wire.SERVER_ROUND: server_round,
                    wire.LEVEL: self.levels[index],
                    wire.LEVEL_INDEX: index,
                    wire.MODEL_SPEC: json.dumps(spec),
                    wire.DATA_SPEC: json.dumps(opts.data_spec(nodes[node_id].num_partitions)),
                    wire.BATCH_SIZE: opts.evaluation.batch_size,
                    **view.wire_config,
                }
            )
            self.bytes_sent += record.count_bytes()
            self.level_of[node_id] = index
            self.messages.append(
                Message(
                    content=RecordDict({ARRAYS: record, CONFIG: config}),
                    dst_node_id=node_id,
                    message_type=MessageType.EVALUATE,
                )
            )

    def score(self, node_id: int, msg: Message) -> tuple[ClientScore | None, str]:
        """Node ``node_id``'s reply as a :class:`ClientScore`, or (None, why it is refused)."""
        if node_id not in self.level_of:
            return None, "reply from a node that was not asked to evaluate"
        if msg.has_error():
            return None, error_reason(msg)
        if METRICS not in msg.content:
            return None, f"reply lacks '{METRICS}'"
        m = msg.content[METRICS]
        n, loss, acc = read_eval(m)
        if type(n) is not int or not 0 < n < 2**63:
            return None, f"num-examples missing or not a positive integer ({n!r:.40})"
        if type(acc) not in (int, float) or not 0.0 <= acc <= 1.0:
            return None, f"eval-accuracy missing or not in [0, 1] ({acc!r:.40})"
        if type(loss) not in (int, float) or not math.isfinite(loss):
            return None, f"eval-loss missing or not finite ({loss!r:.40})"
        return ClientScore(
            self.registry.label(node_id), self.levels[self.level_of[node_id]], int(n), float(loss), float(acc)
        ), ""

    def collect(self, replies: Iterable[Message]) -> dict[str, Any]:
        """The round's federated row entries: figures, failures (with reasons) and bytes."""
        scores: list[ClientScore] = []
        failures: list[tuple[str, str]] = []
        answered: set[int] = set()
        bytes_received = 0
        for node_id, msg in asked_nodes(self.messages, list(replies)):  # keyed by the node asked
            answered.add(node_id)
            try:
                score, why = self.score(node_id, msg)
            except Exception as exc:  # noqa: BLE001 (no reply can raise out of the round)
                score, why = None, f"reply could not be read: {type(exc).__name__}: {exc}"
            if score is None:
                failures.append((self.registry.label(node_id), why))
                if why == NODE_UNAVAILABLE:  # gone: asked again (and logged back) when it reconnects
                    self.registry.forget(node_id, self.server_round, why)
                continue
            bytes_received += content_bytes(msg.content)
            scores.append(score)
        for node_id in sorted(set(self.level_of) - answered, key=self.registry.key):
            failures.append((self.registry.label(node_id), "no reply before the round's deadline (late)"))
        for label, why in failures:
            log(WARNING, "round %d: federated evaluation on node %s failed: %s", self.server_round, label, why)
        scores.sort(key=lambda s: s.node)
        out: dict[str, Any] = federated_figures(scores, self.levels)
        out["fed_failures"] = len(failures)
        if failures:
            out["fed_failure_reasons"] = json.dumps([list(f) for f in failures])
        out["bytes_eval_sent"], out["bytes_eval_received"] = self.bytes_sent, bytes_received
        return out


def numeric(row: dict[str, Any], prefixes: tuple[str, ...]) -> dict[str, float]:
    """The row's finite numbers whose key starts with one of ``prefixes`` (for a MetricRecord)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k.startswith(prefixes) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
