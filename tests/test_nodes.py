"""The node registry: levels that stay put through joins, departures and restarts; waiting for
nodes; distinct client seeds (in process, real strategy and handlers on the LocalGrid)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, RecordDict

from fedhm_flwr.config import model_spec, run_options
from fedhm_flwr.math import levels as lv
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy


def _round(strategy, grid, rnd):
    arrays = ArrayRecord.from_torch_state_dict(initial_state(strategy.opts.seed, strategy.method.spec))
    msgs = list(strategy.configure_train(rnd, arrays, None, grid))
    return {strategy.node_label(m.metadata.dst_node_id): m.content["config"]["level"] for m in msgs}


def _add_node(grid, node_id, config):
    grid.contexts[node_id] = Context(run_id=1, node_id=node_id, node_config=config, state=RecordDict(), run_config={})


def test_levels_do_not_depend_on_how_many_nodes_are_connected(toy_cfg):
    cfg = toy_cfg("num_clients=20")
    # only 5 of the 20 partitions' nodes are connected; each still gets its partition's level
    grid = LocalGrid(5, client_handlers(), node_config=lambda i: {"num-partitions": 20})
    got = _round(FedHMStrategy(run_options(cfg), model_spec(cfg)), grid, 1)
    pool = lv.fixed_levels(range(20), [1, 1, 1, 1], int(cfg.seed))  # the whole run's pool, by hand
    assert got == {f"p{p}": cfg.levels.ratios[pool[p]] for p in range(5)}


def test_a_late_node_reshuffles_nobody_and_a_returning_node_keeps_its_level(toy_cfg, caplog):
    cfg = toy_cfg("num_clients=8")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid = LocalGrid(4, client_handlers(), node_config=lambda i: {"num-partitions": 8})
    first = _round(strategy, grid, 1)
    _add_node(grid, 5000, {"partition-id": 6, "num-partitions": 8})  # joins after round 1
    with caplog.at_level(logging.INFO):
        second = _round(strategy, grid, 2)
    assert {k: second[k] for k in first} == first and "p6" in second
    # p1 leaves, then comes back under a new node id (a restart without SuperNode auth)
    old_id = next(n for n in grid.contexts if grid.contexts[n].node_config["partition-id"] == 1)
    config = dict(grid.contexts.pop(old_id).node_config)
    third = _round(strategy, grid, 3)
    assert "p1" not in third and all(third[k] == second[k] for k in third)
    _add_node(grid, 9000, config)
    with caplog.at_level(logging.INFO):
        fourth = _round(strategy, grid, 4)
    assert fourth == second
    assert any("node p1 is back (node id 9000)" in r.getMessage() for r in caplog.records)
    assert any("node p6 joined" in r.getMessage() for r in caplog.records)


def test_named_nodes_keep_a_hashed_level_whatever_their_node_id(toy_cfg):
    cfg = toy_cfg()
    names = {i: f"device-{i}" for i in range(6)}
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    # no partition ids: real devices known by their node-name only
    grid = LocalGrid(6, client_handlers())
    for ctx in grid.contexts.values():
        pid = ctx.node_config.pop("partition-id")
        ctx.node_config.pop("num-partitions")
        ctx.node_config["node-name"] = names[pid]
    strategy.discovery.refresh(grid, 1)
    by_name = {strategy.nodes[n].name: strategy.levels[strategy.assignment.levels_of[n]] for n in strategy.nodes}
    expected = {
        name: cfg.levels.ratios[lv.hashed_level(f"name:{name}", [1, 1, 1, 1], int(cfg.seed))] for name in names.values()
    }
    assert by_name == expected
    # the same names under other node ids, connecting in reverse order: the same levels
    other = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid2 = LocalGrid(6, client_handlers(), first_node_id=50_000)
    for ctx, name in zip(grid2.contexts.values(), reversed(list(names.values()))):
        ctx.node_config.clear()
        ctx.node_config["node-name"] = name
    other.discovery.refresh(grid2, 1)
    assert {other.nodes[n].name: other.levels[other.assignment.levels_of[n]] for n in other.nodes} == by_name


def test_hashed_levels_follow_the_proportions():
    draws = [lv.hashed_level(f"name:dev-{i}", [1, 3], seed=0) for i in range(8000)]
    assert abs(np.mean(draws) - 0.75) < 0.02
    assert lv.hashed_level("name:x", [1, 3], 0) == lv.hashed_level("name:x", [1, 3], 0)


def test_a_round_waits_for_the_minimum_then_goes_on_or_stops(toy_cfg, caplog):
    cfg = toy_cfg("availability.min_nodes=8 availability.wait_seconds=0.3 availability.poll_seconds=0.05")
    grid = LocalGrid(6, client_handlers())
    with caplog.at_level(logging.INFO):
        got = _round(FedHMStrategy(run_options(cfg), model_spec(cfg)), grid, 1)
    assert len(got) == 6
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "waiting up to 0.3s for at least 8" in text and "going on with the nodes present" in text
    stop = toy_cfg("availability.min_nodes=8 availability.wait_seconds=0.2 availability.on_timeout=stop")
    with pytest.raises(RuntimeError, match=r"availability\.min_nodes"):
        _round(FedHMStrategy(run_options(stop), model_spec(stop)), LocalGrid(6, client_handlers()), 1)


def test_a_node_that_arrives_during_the_wait_ends_it(toy_cfg, caplog):
    cfg = toy_cfg("availability.min_nodes=7 availability.wait_seconds=30 availability.poll_seconds=0.05")
    grid = LocalGrid(6, client_handlers())
    real = grid.get_node_ids
    calls = []

    def arriving():
        calls.append(1)
        if len(calls) == 3:  # the 7th node connects while the round waits
            _add_node(grid, 777, {"partition-id": 6, "num-partitions": 7})
        return real()

    grid.get_node_ids = arriving
    with caplog.at_level(logging.INFO):
        got = _round(FedHMStrategy(run_options(cfg), model_spec(cfg)), grid, 1)
    assert len(got) == 7
    assert any("7 node(s) connected after" in r.getMessage() for r in caplog.records)


def test_client_seeds_are_distinct_across_rounds_and_many_partitions():
    seeds = {lv.client_seed(0, rnd, key) for rnd in range(1, 6) for key in range(3000)}
    assert len(seeds) == 5 * 3000 and all(0 <= s < 2**63 for s in seeds)  # (torch.manual_seed takes 63 bits)
    # the same triple, the same seed (a resumed run trains alike); another run seed, other seeds
    assert lv.client_seed(0, 3, 7) == lv.client_seed(0, 3, 7)
    assert seeds.isdisjoint(lv.client_seed(1, rnd, key) for rnd in range(1, 6) for key in range(3000))


def test_node_info_travels_through_the_one_wire_contract():
    from fedhm_flwr.core import protocol

    sent = protocol.NodeInfo(
        partition_id=3, num_partitions=8, name="ward-3", capability={"memory": 6.5e6}, examples=120
    )
    record = sent.encode()
    assert set(record) == {"partition-id", "num-partitions", "node-name", "capability-memory", "num-examples"}
    assert protocol.NodeInfo.decode(record) == sent
    assert protocol.NodeInfo.decode(protocol.NodeInfo().encode()) == protocol.NodeInfo()


def test_each_node_reports_the_examples_it_trains_on_and_they_add_up(toy_cfg):
    """The start-up's node-info answers (the query carries the data spec) count the examples each
    node then trains on; with the evaluation's held-out examples they make up the training set."""
    cfg = toy_cfg("evaluation.where=both evaluation.holdout=0.2")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid = LocalGrid(6, client_handlers())
    strategy.discovery.startup(grid, 1)
    told = {n: info.examples for n, info in strategy.nodes.items()}
    arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
    trained = {
        m.metadata.src_node_id: int(m.content["metrics"]["num-examples"])
        for m in grid.send_and_receive(list(strategy.configure_train(1, arrays, None, grid)))
    }
    assert told == trained and len(told) == 6
    evaluated = [
        int(m.content["metrics"]["num-examples"])
        for m in grid.send_and_receive(list(strategy.configure_evaluate(1, arrays, None, grid)))
    ]
    assert len(evaluated) == 6 and sum(told.values()) + sum(evaluated) == int(cfg.dataset.max_train_examples)
    assert 0 < sum(evaluated) < sum(told.values())


def test_a_node_whose_data_cannot_serve_the_run_sits_out_from_the_start(toy_cfg, caplog):
    cfg = toy_cfg()
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    # node 3 claims a partition the run does not have (partition ids 0..5)
    grid = LocalGrid(6, client_handlers(), node_config=lambda i: {"partition-id": 9} if i == 3 else {})
    with caplog.at_level(logging.WARNING):
        strategy.discovery.startup(grid, 1)
    assert len(strategy.nodes) == 5 and 9 not in {info.partition_id for info in strategy.nodes.values()}
    assert any("cannot take part" in r.getMessage() and "partition-id" in r.getMessage() for r in caplog.records)
    assert len(_round(strategy, grid, 1)) == 5


def test_many_nodes_joining_at_once_are_logged_as_level_counts(toy_cfg, caplog):
    cfg = toy_cfg("num_clients=20")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    with caplog.at_level(logging.INFO):
        strategy.discovery.startup(LocalGrid(20, client_handlers()), 1)
    lines = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("round 1: 20 nodes joined -> ")
    counts = {
        float(part.split(": ")[0].removeprefix("level ")): int(part.split(": ")[1])
        for part in lines[0].split(" -> ")[1].split(", ")
    }
    held = [strategy.levels[i] for i in strategy.assignment.levels_of.values()]
    assert counts == {level: held.count(level) for level in set(held)} and sum(counts.values()) == 20


def test_the_start_up_waits_for_round_1_once_and_later_rounds_wait_again(toy_cfg, caplog):
    cfg = toy_cfg("availability.min_nodes=8 availability.wait_seconds=0.2 availability.poll_seconds=0.05")
    strategy, grid = FedHMStrategy(run_options(cfg), model_spec(cfg)), LocalGrid(6, client_handlers())

    def waits():
        return sum("waiting up to 0.2s for at least 8" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO):
        strategy.discovery.startup(grid, 1)
        assert waits() == 1 and len(strategy.nodes) == 6
        assert len(_round(strategy, grid, 1)) == 6 and waits() == 1  # the start-up's wait was round 1's
        assert len(_round(strategy, grid, 2)) == 6 and waits() == 2


def test_a_node_that_sits_out_is_recorded_and_asked_again_only_when_it_reconnects(toy_cfg, tmp_path, caplog):
    from flwr.app import MessageType

    from fedhm_flwr.ops.apps.server_app import run

    cfg = toy_cfg("rounds=3 num_clients=4 evaluation.levels=false")
    # node 3 claims a partition the run does not have (its data cannot serve the run)
    grid = LocalGrid(4, client_handlers(), node_config=lambda i: {"partition-id": 9} if i == 3 else {})
    bad = next(n for n, ctx in grid.contexts.items() if ctx.node_config["partition-id"] == 9)
    summary = run(grid, cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    queries = lambda: sum(1 for n, kind in grid.delivered if n == bad and kind == MessageType.QUERY)  # noqa: E731
    assert queries() == 1  # asked once (the start-up), not every round
    for row in rows:
        ((label, why),) = json.loads(row["excluded"]).items()
        assert label == f"n{bad}" and "partition-id" in why and "n" + str(bad) not in row["assignments"]
        assert row["sampled"] == 3 and row["failures"] == 0
    assert summary["excluded"] == json.loads(rows[-1]["excluded"])
    # it leaves and reconnects: asked again, once
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    strategy.discovery.startup(grid, 1)
    context = grid.contexts.pop(bad)
    with caplog.at_level(logging.INFO):
        _round(strategy, grid, 1)
        assert strategy.round_log.excluded == {}
        grid.contexts[bad] = context
        _round(strategy, grid, 2)
        _round(strategy, grid, 3)
    assert queries() == 3  # the run's one, this start-up's one, the one after it reconnected
    assert strategy.round_log.excluded == {f"n{bad}": json.loads(rows[0]["excluded"])[f"n{bad}"]}
    assert any(f"node {bad}, which sat out, left" in r.getMessage() for r in caplog.records)


def test_sampling_nodes_not_yet_queried_draws_the_same_sets_and_hashes_each_node_once(toy_cfg, monkeypatch):
    """``availability.query = sampled``: a node not queried yet takes part by the hash of its node
    id. The draws are the documented ones (sha256 key, the round's generator over the sorted keys),
    and a node's key is hashed once however many rounds draw it."""
    import hashlib

    import fedhm_flwr.server.known_nodes as nodes

    cfg = toy_cfg("num_clients=40 fraction_train=0.3 seed=11 availability.query=sampled")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid = LocalGrid(40, client_handlers())
    hashed = []
    real = hashlib.sha256
    monkeypatch.setattr(nodes.hashlib, "sha256", lambda data: hashed.append(data) or real(data))
    nodes.hashed_key.cache_clear()
    for rnd in (1, 2, 3, 2):
        strategy.discovery.refresh(grid, rnd)
        assert sorted(strategy.known.unknown) == sorted(grid.get_node_ids())  # none queried yet
        keys = {(1 << 40) + int(real(f"node:{n}".encode()).hexdigest()[:12], 16): n for n in grid.get_node_ids()}
        expected = np.random.default_rng([11, rnd, 0]).choice(sorted(keys), size=12, replace=False)
        assert sorted(strategy.sampler.sample(rnd)) == sorted(keys[int(k)] for k in expected)
    assert len(hashed) == 40  # one hash per node, not one per node and draw


def test_answers_asked_ahead_are_pulled_with_the_round_s_replies_and_counted_by_the_round_that_reads_them(
    toy_cfg, tmp_path, monkeypatch
):
    """``availability.query = sampled``: ``start()`` asks the next round's new nodes behind this
    round's training and pulls their answers along with its replies, so that none waits in the
    grid while the round aggregates (under the simulation engine every stored message slows every
    delivery); the round that samples those nodes still counts them as asked, with their bytes."""
    from fedhm_flwr.ops.apps.server_app import run

    cfg = toy_cfg("rounds=4 num_clients=20 fraction_train=0.25 availability.query=sampled evaluation.levels=false")
    grid = LocalGrid(20, client_handlers())
    waiting, aggregate = [], FedHMStrategy.aggregate_train

    def spy(self, server_round, replies):
        waiting.append(len(grid._replies))  # replies pushed to the grid and not pulled yet
        return aggregate(self, server_round, replies)

    monkeypatch.setattr(FedHMStrategy, "aggregate_train", spy)
    run(grid, cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert waiting == [0, 0, 0, 0]
    trained = [set(json.loads(row["assignments"])) for row in rows]
    assert rows[0]["queried"] == 0  # the start-up asked round 1's nodes
    for rnd in range(1, 4):
        new = trained[rnd] - set().union(*trained[:rnd])
        assert rows[rnd]["queried"] == len(new)
        assert (rows[rnd]["bytes_queries"] > 0) == bool(new)
