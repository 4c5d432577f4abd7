"""Failures, malformed replies, checkpoint/resume and determinism, through the shared base."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, MessageType
from flwr.common.constant import ErrorCode

from fedhm_flwr.config import model_spec, resume_config, run_options
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state, run
from fedhm_flwr.reporting.results import load_checkpoint
from fedhm_flwr.server.registry import FedHMStrategy

# (a resumed server process asks every node for its node info again, in its start-up: no round's row differs)
TIMING = (
    "seconds",
    "server_seconds",
    "query_seconds",
    "eval_seconds",
    "client_seconds_max",
    "reply_seconds_median",
    "reply_seconds_max",
    "train_seconds",
    "client_seconds_sum",
    "deploy_stats_seconds",
)


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_injected_crashes_are_counted_and_the_run_completes(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=3 failures.crash_probability=0.4")
    summary = run(LocalGrid(6, client_handlers()), cfg, tmp_path)
    rows = _rows(tmp_path)
    assert summary["rounds_completed"] == 3
    assert summary["failures"] > 0
    for r in rows:
        reasons = json.loads(r.get("failure_reasons", "[]"))
        assert r["failures"] == sum("injected client crash" in why for _, why in reasons)
        assert r["failures"] + r["replies"] == r["sampled"] == 6


def test_a_client_slower_than_the_round_timeout_is_counted_late_not_failed(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=1 failures.slow_probability=0.5 failures.slow_seconds=1.5 timeout=1.0")
    run(LocalGrid(6, client_handlers(), timeout=float(cfg.timeout)), cfg, tmp_path)
    (row,) = _rows(tmp_path)
    assert row["failures"] == 0 and "failure_reasons" not in row
    assert row["late"] > 0 and len(json.loads(row["late_nodes"])) == row["late"]
    assert row["replies"] == 6 - row["late"]


# the malformed replies: tests/test_hostile_replies.py (every class of fedhm_flwr/client/hostile.py)


def test_the_order_replies_arrive_in_changes_neither_the_model_nor_the_round_s_figures(toy_cfg):
    """Replies come in whatever order the grid gives (a set of random message ids); the merge and
    the round's training figures are sums, which floating point makes order-dependent, so both
    take the replies in node order. Losses of very different sizes make any other order show."""
    cfg = toy_cfg()
    spec = model_spec(cfg)
    state = initial_state(cfg.seed, spec)
    losses = {0: 1e16, 1: 1.0, 2: -1e16, 3: 1.0, 4: 0.5, 5: 0.25}
    handlers = client_handlers()
    real = handlers[MessageType.TRAIN]

    def train(msg, ctx):
        reply = real(msg, ctx)
        reply.content["metrics"]["train-loss"] = losses[int(ctx.node_config["partition-id"])]
        return reply

    handlers[MessageType.TRAIN] = train
    seen = []
    for order in (lambda r: r, lambda r: r[::-1], lambda r: r[2:] + r[:2]):
        strategy, grid = FedHMStrategy(run_options(cfg), spec), LocalGrid(6, handlers)
        msgs = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid))
        replies = sorted(grid.send_and_receive(msgs), key=lambda m: m.metadata.src_node_id)
        arrays, metrics = strategy.aggregate_train(1, order(replies))
        figures = {k: v for k, v in metrics.items() if not k.startswith("client-seconds")}  # (timings)
        seen.append((arrays.to_torch_state_dict(), figures, strategy._round_row(1, metrics)))
    first_state, first_metrics, first_row = seen[0]
    assert first_metrics["replies"] == 6
    for new_state, metrics, row in seen[1:]:
        assert all(torch.equal(new_state[k], first_state[k]) for k in first_state)
        assert metrics == first_metrics and _untimed([row]) == _untimed([first_row])


def test_resumed_run_ends_like_an_uninterrupted_one(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=3 checkpoint.every=1")
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    run(LocalGrid(6, client_handlers()), cfg, full_dir)

    class Stop(Exception):
        pass

    handlers = client_handlers()
    real = handlers[MessageType.TRAIN]

    def stop_in_round_3(msg, ctx):
        if msg.content["config"]["server-round"] == 3:
            raise Stop
        return real(msg, ctx)

    grid = LocalGrid(6, handlers)
    push = grid.push_messages

    def send(messages):  # the server process dies during round 3
        messages = list(messages)
        if (
            messages
            and messages[0].metadata.message_type == MessageType.TRAIN
            and messages[0].content["config"]["server-round"] == 3
        ):
            raise Stop
        return push(messages)

    grid.push_messages = send
    with pytest.raises(Stop):
        run(grid, cfg, cut_dir)
    _, saved = load_checkpoint(cut_dir)
    assert saved["round"] == 2
    resumed_cfg = resume_config(cut_dir)
    run(LocalGrid(6, client_handlers()), resumed_cfg, cut_dir, resume=cut_dir)
    a, _ = load_checkpoint(full_dir)
    b, saved_b = load_checkpoint(cut_dir)
    assert saved_b["round"] == 3
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _untimed(_rows(full_dir)) == _untimed(_rows(cut_dir))


def test_same_seed_same_metrics_other_seed_other_metrics(toy_cfg, tmp_path):
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run(LocalGrid(6, client_handlers()), toy_cfg(f"rounds=2 seed={seed} fraction_train=0.5"), tmp_path / name)
        runs[name] = _untimed(_rows(tmp_path / name))
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_a_new_run_never_overwrites_an_earlier_one(toy_cfg, tmp_path):
    run(LocalGrid(6, client_handlers()), toy_cfg("rounds=1"), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(FileExistsError):
        run(LocalGrid(6, client_handlers()), toy_cfg("rounds=1"), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_bytes_moved_count_configs_queries_and_rejected_replies(toy_cfg):
    from fedhm_flwr.server.strategy import content_bytes

    cfg = toy_cfg()
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid = LocalGrid(6, client_handlers())
    arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
    msgs = list(strategy.configure_train(1, arrays, None, grid))
    assert strategy.round_log.sent_bytes == sum(content_bytes(m.content) for m in msgs)
    assert strategy.round_log.sent_bytes > sum(m.content["arrays"].count_bytes() for m in msgs)  # configs count
    assert strategy.round_log.query_bytes > 0  # the node-info queries of the 6 new nodes and their answers
    replies = list(grid.send_and_receive(msgs))
    bad = replies[0]
    bad.content["metrics"]["num-examples"] = 0  # malformed: rejected, but its bytes did travel
    strategy.aggregate_train(1, replies)
    assert len(strategy.round_log.rejected) == 1
    assert strategy.round_log.received_bytes == sum(content_bytes(r.content) for r in replies)
    again = list(strategy.configure_train(2, arrays, None, grid))
    assert again and strategy.round_log.query_bytes == 0  # known nodes are not asked again


class _Vanishing(LocalGrid):
    """A LocalGrid whose SuperLink answers itself for some messages: Flower's ``Node Unavailable``
    reply (from the SuperLink's own node id 1), as for a SuperNode killed after it took its message."""

    def __init__(self, *args, gone=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.gone = set(gone)  # (server round, message type, partition id) answered by the SuperLink

    def _deliver(self, msg):
        config = msg.content["config"]
        pid = self.contexts[msg.metadata.dst_node_id].node_config["partition-id"]
        if (config.get("server-round"), msg.metadata.message_type, pid) not in self.gone:
            return super()._deliver(msg)
        reply = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = 1  # what Flower's SuperLink sends
        assert reply.metadata.src_node_id == 1
        return reply


def test_a_node_the_superlink_reports_unavailable_is_one_failure_leaves_and_is_back(toy_cfg, tmp_path, caplog):
    cfg = toy_cfg("rounds=3 evaluation.where=both evaluation.levels=false")
    grid = _Vanishing(6, client_handlers(), gone={(2, MessageType.TRAIN, 2), (1, MessageType.EVALUATE, 3)})
    with caplog.at_level(logging.INFO):
        run(grid, cfg, tmp_path)
    rows = _rows(tmp_path)
    log = "\n".join(r.getMessage() for r in caplog.records)
    # round 1: p3 cannot evaluate: one federated failure, under its own name, with the true reason
    assert rows[0]["fed_failures"] == 1 and json.loads(rows[0]["fed_failure_reasons"]) == [["p3", "node unavailable"]]
    # round 2: p2 took its training message and vanished: exactly one failure, p2's, "node unavailable"
    # (not the SuperLink's id, not a timeout); it did not train and is not asked to evaluate
    assert rows[1]["sampled"] == 6 and rows[1]["replies"] == 5 and rows[1]["failures"] == 1
    assert json.loads(rows[1]["failure_reasons"]) == [["p2", "node unavailable"]]
    assert "p2" not in json.loads(rows[1]["assignments"]) and len(json.loads(rows[1]["assignments"])) == 5
    assert rows[1]["fed_clients"] == 5 and rows[1]["fed_failures"] == 0
    # evaluation messages that reached a node: round 1 all but p3's (answered by the SuperLink), round 2
    # the five that trained, round 3 all six
    assert sum(1 for n, kind in grid.delivered if kind == MessageType.EVALUATE) == 5 + 5 + 6
    # the registry saw both go and come back (asked again, same level)
    assert "node p3 (node id" in log and "left (node unavailable)" in log
    assert "round 2: node p3 is back" in log and "round 3: node p2 is back" in log
    assert json.loads(rows[2]["assignments"]) == json.loads(rows[0]["assignments"])
    assert rows[2]["failures"] == 0 and "failure_reasons" not in rows[2]


def test_the_deadline_waits_for_a_quorum_then_follows_the_answers_pace():
    from fedhm_flwr.server.transport import Deadline

    d = Deadline(timeout=600, quorum=0.5, factor=4, floor=30)
    assert d.end(10, [1.0, 2.0, 3.0, 4.0]) == 600  # 4 of 10: no quorum yet, the timeout holds
    assert d.end(10, [10.0, 20.0, 30.0, 40.0, 50.0]) == 4 * 30  # 4x the median of the answers in
    assert d.end(10, [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]) == 4 * 35  # it moves on as answers come
    assert d.end(10, [1.0, 1.0, 1.0, 1.0, 2.0]) == 30  # never before the floor
    assert d.end(10, [100.0, 200.0, 300.0, 400.0, 500.0]) == 600  # never after the timeout
    assert d.end(3, [5.0, 7.0]) == 30 and d.end(1, [0.5]) == 30  # ceil(0.5 x 3) = 2; one of one
    assert Deadline(600, 0.5, float("inf"), 30).end(10, [1.0] * 9) == 600  # factor inf: wait for all
    # nodes served one after another (a simulation's workers) arrive evenly: the deadline stays ahead of them
    arrivals = [float(i) for i in range(1, 101)]
    assert all(d.end(100, arrivals[:k]) > arrivals[k - 1] for k in range(50, 101))
