"""One FedHM round through the shared base, in process (Flower messages, no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from reply_helpers import reply

import fedhm_flwr.math.lowrank as lowrank
from fedhm_flwr.config import model_spec, run_options
from fedhm_flwr.data import client_dataset
from fedhm_flwr.math.aggregation import level_weights
from fedhm_flwr.models import build_model
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state, run
from fedhm_flwr.server.registry import FedHMStrategy


def _strategy(cfg):
    return FedHMStrategy(run_options(cfg), model_spec(cfg))


def _configure(strategy, grid, state, rnd=1):
    return list(strategy.configure_train(rnd, ArrayRecord.from_torch_state_dict(state), None, grid))


def test_one_svd_per_factorizable_layer_per_round_whatever_the_levels(toy_cfg, monkeypatch):
    cfg = toy_cfg("num_clients=12")
    strategy = _strategy(cfg)
    calls = []
    real = lowrank.layer_svd
    monkeypatch.setattr(lowrank, "layer_svd", lambda w, *a: calls.append(tuple(w.shape)) or real(w, *a))
    grid = LocalGrid(12, client_handlers())
    messages = _configure(strategy, grid, initial_state(cfg.seed, strategy.method.spec))
    levels_sent = {json.loads(m.content["config"]["model-spec"]).get("ranks") is not None for m in messages}
    assert levels_sent == {True, False}  # full and factorized levels in this round
    assert len(calls) == len(strategy.method.factorized) > 0


def test_each_node_receives_its_levels_hybrid_model(toy_cfg):
    cfg = toy_cfg()
    strategy = _strategy(cfg)
    grid = LocalGrid(6, client_handlers())
    state = initial_state(cfg.seed, strategy.method.spec)
    for msg in _configure(strategy, grid, state):
        config = msg.content["config"]
        spec = json.loads(config["model-spec"])
        index = config["level-index"]
        assert spec.get("ranks", {}) == strategy.method.ranks[index]
        expected = build_model(spec, spectral_init=False).state_dict()
        got = msg.content["arrays"].to_torch_state_dict()
        assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in expected.items()}
        if strategy.levels[index] == 1.0:  # full level: the global model itself
            assert all(torch.equal(got[k], state[k]) for k in state)
        else:  # factorized level: its recovery is the truncated SVD of the global weights
            rec = lowrank.recover_state(got, strategy.method.ranks[index])
            name = next(iter(strategy.method.ranks[index]))
            svd = lowrank.layer_svd(state[f"{name}.weight"])
            r = strategy.method.ranks[index][name]
            truncated = (svd.U[:, :r] * svd.S[:r]) @ svd.Vh[:r]
            got_m = lowrank.layer_matrix(rec[f"{name}.weight"]).double()
            assert torch.allclose(got_m, truncated, atol=1e-5)


def _shift_handler(shift_by_pid, counts_by_pid):
    """A client that adds a known constant to every received tensor."""

    def handle(msg, context):
        pid = int(context.node_config["partition-id"])
        arrays = msg.content["arrays"].to_torch_state_dict()
        out = {k: v + shift_by_pid[pid] for k, v in arrays.items()}
        return reply(msg, out, 10 + pid, counts_by_pid[pid])

    return handle


def test_aggregation_recovers_and_weights_by_softmax_gamma(toy_cfg):
    cfg = toy_cfg("method.tau=0.5")
    strategy = _strategy(cfg)
    shift = {pid: 0.01 * (pid + 1) for pid in range(6)}
    counts = {pid: [1] * 10 for pid in range(6)}
    counts[0] = [0] * 9 + [5]  # partition 0 holds only class 9
    handlers = client_handlers()
    handlers[MessageType.TRAIN] = _shift_handler(shift, counts)
    grid = LocalGrid(6, handlers)
    state = initial_state(cfg.seed, strategy.method.spec)
    messages = _configure(strategy, grid, state)
    replies = grid.send_and_receive(messages)
    new_arrays, metrics = strategy.aggregate_train(1, replies)
    new = new_arrays.to_torch_state_dict()
    # by hand: recover each reply, weights softmax(gamma/tau)
    pids, levels, recovered = [], [], []
    for msg in replies:
        node = msg.metadata.src_node_id
        index, _ = strategy.wire.sent[node]
        pids.append(strategy.nodes[node].partition_id)
        levels.append(strategy.levels[index])
        recovered.append(
            lowrank.recover_state(msg.content["arrays"].to_torch_state_dict(), strategy.method.ranks[index])
        )
    w = level_weights(levels, 0.5)
    key = "conv3.weight"
    expected = sum(wi * r[key].double() for wi, r in zip(w, recovered))
    assert torch.allclose(new[key].double(), expected, atol=1e-5)
    # classifier row of class 0: partition 0 does not hold it, so its weight is renormalised away
    holders = [i for i, pid in enumerate(pids) if pid != 0]
    w0 = w[holders] / w[holders].sum()
    row0 = sum(wi * recovered[i]["fc.weight"][0].double() for wi, i in zip(w0, holders))
    assert torch.allclose(new["fc.weight"][0].double(), row0, atol=1e-6)
    assert metrics["replies"] == 6


def test_client_errors_are_counted_and_never_fatal(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=2")
    handlers = client_handlers()
    real_train = handlers[MessageType.TRAIN]

    def flaky(msg, context):
        if int(context.node_config["partition-id"]) in (1, 4):
            raise RuntimeError("device ran out of battery")
        return real_train(msg, context)

    handlers[MessageType.TRAIN] = flaky
    summary = run(LocalGrid(6, handlers), cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["failures"] for r in rows] == [2, 2]
    assert [r["replies"] for r in rows] == [4, 4]
    assert summary["failures"] == 4 and summary["rounds_completed"] == 2
    assert "battery" in rows[0]["failure_reasons"]


def test_all_replies_failing_keeps_the_global_model(toy_cfg):
    cfg = toy_cfg()
    strategy = _strategy(cfg)
    handlers = client_handlers()
    handlers[MessageType.TRAIN] = lambda msg, ctx: (_ for _ in ()).throw(RuntimeError("boom"))
    grid = LocalGrid(6, handlers)
    state = initial_state(cfg.seed, strategy.method.spec)
    replies = grid.send_and_receive(_configure(strategy, grid, state))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["replies"] == 0
    assert len(strategy.round_log.failures) == 6


@pytest.mark.parametrize("assignment", ["fixed", "dynamic"])
def test_level_assignment_modes(toy_cfg, assignment):
    cfg = toy_cfg(f"levels.assignment={assignment} num_clients=12 fraction_train=1.0")
    strategy = _strategy(cfg)
    grid = LocalGrid(12, client_handlers())
    state = initial_state(cfg.seed, strategy.method.spec)
    per_round = []
    for rnd in (1, 2, 3):
        msgs = _configure(strategy, grid, state, rnd)
        per_round.append({m.metadata.dst_node_id: m.content["config"]["level-index"] for m in msgs})
    counts = np.bincount(list(per_round[0].values()), minlength=4)
    if assignment == "fixed":
        assert per_round[0] == per_round[1] == per_round[2]
        assert counts.tolist() == [3, 3, 3, 3]
    else:
        assert per_round[0] != per_round[1] or per_round[1] != per_round[2]


def test_declared_capabilities_override_the_assignment(toy_cfg):
    cfg = toy_cfg()
    strategy = _strategy(cfg)
    declared = {0: {"capability-level": 0.25}, 1: {"capability-params": 0.6 * strategy.method.level_cost(0)["params"]}}
    grid = LocalGrid(6, client_handlers(), node_config=lambda i: declared.get(i, {}))
    msgs = _configure(strategy, grid, initial_state(cfg.seed, strategy.method.spec))
    by_pid = {strategy.nodes[m.metadata.dst_node_id].partition_id: m.content["config"]["level"] for m in msgs}
    assert by_pid[0] == 0.25
    # the largest level whose parameter count fits 60 % of the full model's
    fits = [
        lvl
        for i, lvl in enumerate(strategy.levels)
        if strategy.method.level_cost(i)["params"] <= declared[1]["capability-params"]
    ]
    assert by_pid[1] == max(fits) < 1.0


def test_nodes_sharing_a_partition_id_are_all_kept(toy_cfg):
    cfg = toy_cfg("fraction_train=1.0")
    strategy = _strategy(cfg)
    grid = LocalGrid(6, client_handlers(), node_config=lambda i: {"partition-id": min(i, 3)})  # 3, 4, 5 -> "3"
    msgs = _configure(strategy, grid, initial_state(cfg.seed, strategy.method.spec))
    assert len({m.metadata.dst_node_id for m in msgs}) == 6
    keys = {strategy.known.key(n) for n in strategy.nodes}
    assert len(keys) == 6


def test_client_evaluate_handler_scores_the_received_model_on_local_data(toy_cfg):
    cfg = toy_cfg("evaluation.where=both evaluation.holdout=0.2")
    strategy = _strategy(cfg)
    grid = LocalGrid(6, client_handlers())
    (train_msg, *_) = _configure(strategy, grid, initial_state(cfg.seed, strategy.method.spec))
    content = RecordDict({"arrays": train_msg.content["arrays"], "config": train_msg.content["config"]})
    msg = Message(content=content, dst_node_id=train_msg.metadata.dst_node_id, message_type=MessageType.EVALUATE)
    (reply,) = grid.send_and_receive([msg])
    metrics = reply.content["metrics"]
    assert not reply.has_error() and metrics["num-examples"] > 0
    assert 0.0 <= metrics["eval-accuracy"] <= 1.0 and metrics["eval-loss"] > 0
    # on the node's held-out examples (a fifth of its partition), not on what it trains on
    pid = strategy.nodes[msg.metadata.dst_node_id].partition_id
    spec = json.loads(str(train_msg.content["config"]["data-spec"]))
    assert metrics["num-examples"] == len(client_dataset(spec, pid, split="heldout"))
    assert metrics["num-examples"] < len(client_dataset(spec, pid, split="train"))


def test_one_decomposition_per_layer_per_model_version_evaluation_included(toy_cfg, tmp_path, monkeypatch):
    """A whole run on the in-process grid, every level evaluated every round: the hand-out, the
    evaluation of each level's deployable model and the next round's hand-out share one
    decomposition per factorizable layer of each model version (the initial one, then one per round)."""
    cfg = toy_cfg("rounds=2 evaluation.levels=true evaluation.every=1")
    calls = []
    real = lowrank.layer_svd
    monkeypatch.setattr(lowrank, "layer_svd", lambda w, *a: calls.append(tuple(w.shape)) or real(w, *a))
    run(LocalGrid(6, client_handlers()), cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(
        len([k for k in r if k.startswith("acc/level_")]) == len(cfg.levels.ratios) > 1 for r in rows
    )
    factorized = _strategy(cfg).method.factorized
    assert len(factorized) > 0 and len(calls) == (2 + 1) * len(factorized)


def test_start_honours_flowers_evaluate_fn_before_the_first_round_and_after_each(toy_cfg):
    """Flower's ``Strategy.start`` contract: a given ``evaluate_fn(round, arrays)`` is called with the
    initial arrays (round 0) and after every round with that round's global model; what it returns
    is kept in ``evaluate_metrics_serverapp`` and joins the round's row."""
    cfg = toy_cfg("rounds=2 evaluation.levels=false")
    strategy = _strategy(cfg)
    initial = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
    seen = []

    def evaluate_fn(server_round, arrays):
        seen.append((server_round, arrays.to_torch_state_dict()))
        return MetricRecord({"extra-metric": float(10 + server_round)})

    result = strategy.start(LocalGrid(6, client_handlers()), initial, num_rounds=2, evaluate_fn=evaluate_fn)
    assert [r for r, _ in seen] == [0, 1, 2]
    assert all(torch.equal(seen[0][1][k], v) for k, v in initial.to_torch_state_dict().items())
    final = result.arrays.to_torch_state_dict()
    assert all(torch.equal(seen[2][1][k], v) for k, v in final.items())
    assert any(not torch.equal(seen[1][1][k], seen[0][1][k]) for k in final)  # round 1's model, not the initial one
    assert result.evaluate_metrics_serverapp[0]["extra-metric"] == 10.0
    assert result.evaluate_metrics_serverapp[2]["extra-metric"] == 12.0
    assert "acc/global" in result.evaluate_metrics_serverapp[2] or strategy.evaluate_fn is None
    assert [row["extra-metric"] for row in strategy.history] == [11.0, 12.0]
