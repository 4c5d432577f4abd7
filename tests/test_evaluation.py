"""Evaluation: the pure statistics, federated (client-side) evaluation in a real round, a server
without a test set, and the two sBN defects (no client answering, a last single-example batch)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from flwr.app import MessageType
from torch.utils.data import TensorDataset

import fedhm_flwr.data
import fedhm_flwr.server.evaluation as ev
from fedhm_flwr.math.bn_stats import bn_sums
from fedhm_flwr.models import build_model
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.reporting.summary import collect, markdown_table

FED_KEYS = (
    "fed_acc/all",
    "fed_loss/all",
    "fed_clients",
    "fed_acc_clients/mean",
    "fed_acc_clients/std",
    "fed_acc_clients/worst10",
    "fed_failures",
    "bytes_eval_sent",
    "bytes_eval_received",
)


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------- pure statistics


def test_weighted_mean_and_spread_on_numbers_worked_by_hand():
    assert ev.weighted_mean([0.5, 1.0], [1, 3]) == pytest.approx(3.5 / 4)
    assert math.isnan(ev.weighted_mean([], []))
    spread = ev.client_spread([0.9, 0.1, 0.5, 0.7])
    # mean 0.55; deviations .35 -.45 -.05 .15 -> squares sum .35 -> population variance .0875
    assert spread["mean"] == pytest.approx(0.55)
    assert spread["std"] == pytest.approx(math.sqrt(0.0875))
    assert spread["worst10"] == pytest.approx(0.1)  # ceil(0.4) = 1 client
    eleven = [1.0] * 9 + [0.2, 0.4]  # ceil(1.1) = 2 worst clients: (0.2 + 0.4) / 2
    assert ev.client_spread(eleven)["worst10"] == pytest.approx(0.3)
    ten = [0.05 * i for i in range(10)]  # exactly 10 %: one client
    assert ev.client_spread(ten)["worst10"] == pytest.approx(0.0)


def test_federated_figures_weight_by_examples_and_split_by_level():
    scores = [
        ev.ClientScore("p0", 1.0, 100, 0.5, 0.8),
        ev.ClientScore("p1", 1.0, 300, 1.0, 0.4),
        ev.ClientScore("p2", 0.25, 100, 2.0, 0.2),
    ]
    out = ev.federated_figures(scores, [1.0, 0.5, 0.25])
    assert out["fed_acc/all"] == pytest.approx((80 + 120 + 20) / 500)
    assert out["fed_loss/all"] == pytest.approx((50 + 300 + 200) / 500)
    assert out["fed_acc/level_1"] == pytest.approx(200 / 400) and out["fed_acc/level_0.25"] == pytest.approx(0.2)
    assert out["fed_loss/level_1"] == pytest.approx(350 / 400)
    assert (
        out["fed_clients"],
        out["fed_clients/level_1"],
        out["fed_clients/level_0.5"],
        out["fed_clients/level_0.25"],
    ) == (3, 2, 0, 1)
    assert "fed_acc/level_0.5" not in out  # no client: no figure, not a zero
    assert out["fed_acc_clients/mean"] == pytest.approx(1.4 / 3)  # unweighted: each client once
    assert out["fed_acc_clients/worst10"] == pytest.approx(0.2)


# ---------------------------------------------------------------------- federated evaluation in a run


def test_clients_evaluate_at_their_level_and_figures_are_the_weighted_replies(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=2 num_clients=8 fraction_train=0.5 evaluation.where=both")
    handlers = client_handlers()
    real_train, real_eval = handlers[MessageType.TRAIN], handlers[MessageType.EVALUATE]
    trained, asked, replies = [], [], []  # (round, partition, level); (round, level, reply metrics)

    def train(msg, context):
        config = msg.content["config"]
        trained.append((int(config["server-round"]), context.node_config["partition-id"], float(config["level"])))
        return real_train(msg, context)

    def evaluate(msg, context):
        config = msg.content["config"]
        rnd = int(config["server-round"])
        asked.append((rnd, context.node_config["partition-id"], float(config["level"])))
        if len([a for a in asked if a[0] == rnd]) == 1:  # the first node asked each round fails
            raise RuntimeError("evaluation crashed")
        reply = real_eval(msg, context)
        replies.append((rnd, float(config["level"]), dict(reply.content["metrics"])))
        return reply

    handlers[MessageType.TRAIN], handlers[MessageType.EVALUATE] = train, evaluate
    summary = run(LocalGrid(8, handlers), cfg, tmp_path)
    rows = _rows(tmp_path)
    assert len(rows) == 2 and summary["rounds_completed"] == 2
    for row in rows:
        rnd = row["round"]
        assert all(k in row for k in FED_KEYS) and "acc/global" in row  # both: server figures stay
        # the nodes asked to evaluate are exactly the round's trained nodes, each at its training level
        assert sorted(a[1:] for a in asked if a[0] == rnd) == sorted(t[1:] for t in trained if t[0] == rnd)
        assert len([t for t in trained if t[0] == rnd]) == 4
        asked_levels = Counter(a[2] for a in asked if a[0] == rnd)
        for level in cfg.levels.ratios:
            assert asked_levels[level] == row[f"clients/level_{level:g}"]
        failed_level = next(a[2] for a in asked if a[0] == rnd)
        for level in cfg.levels.ratios:
            assert row[f"fed_clients/level_{level:g}"] == row[f"clients/level_{level:g}"] - (level == failed_level)
        assert (
            row["fed_failures"] == 1 and row["fed_clients"] == 3 and "evaluation crashed" in row["fed_failure_reasons"]
        )
        mine = [m for r, _, m in replies if r == rnd]
        n = sum(m["num-examples"] for m in mine)
        assert row["fed_acc/all"] == pytest.approx(
            sum(m["num-examples"] * m["eval-accuracy"] for m in mine) / n, abs=1e-12
        )
        assert row["fed_loss/all"] == pytest.approx(
            sum(m["num-examples"] * m["eval-loss"] for m in mine) / n, abs=1e-12
        )
        for level in {lvl for r, lvl, _ in replies if r == rnd}:
            ms = [m for r, lvl, m in replies if r == rnd and lvl == level]
            expected = sum(m["num-examples"] * m["eval-accuracy"] for m in ms) / sum(m["num-examples"] for m in ms)
            assert row[f"fed_acc/level_{level:g}"] == pytest.approx(expected, abs=1e-12)
        assert row["fed_acc_clients/worst10"] == pytest.approx(min(m["eval-accuracy"] for m in mine))  # ceil(0.3)=1
        assert row["bytes_eval_sent"] > 0 and row["bytes_eval_received"] > 0
    assert summary["final_fed_acc/all"] == rows[-1]["fed_acc/all"]
    assert summary["best_fed_acc/all"] == max(r["fed_acc/all"] for r in rows)
    assert summary["final_fed_acc_clients/worst10"] == rows[-1]["fed_acc_clients/worst10"]
    assert summary["fed_failures"] == 2
    assert summary["bytes_total"] == (
        summary["bytes_sent"]
        + summary["bytes_received"]
        + summary["bytes_bn_stats"]
        + sum(r["bytes_eval_sent"] + r["bytes_eval_received"] for r in rows)
        + summary["bytes_queries"]
    )


def test_a_server_without_a_test_set_runs_with_client_evaluation_only(toy_cfg, tmp_path, monkeypatch):
    def no_test_set(*args, **kwargs):
        raise AssertionError("the server's test set was loaded")

    monkeypatch.setattr(ev, "test_dataset", no_test_set)
    monkeypatch.setattr(fedhm_flwr.data, "test_dataset", no_test_set)
    cfg = toy_cfg("rounds=2 evaluation.every=2 evaluation.where=clients")
    grid = LocalGrid(6, client_handlers())
    summary = run(grid, cfg, tmp_path)
    rows = _rows(tmp_path)
    assert [("fed_acc/all" in r) for r in rows] == [False, True]  # evaluation rounds only
    assert not any(k.startswith(("acc/", "loss/")) for r in rows for k in r)
    assert rows[-1]["fed_clients"] == 6 and rows[-1]["fed_failures"] == 0
    assert sum(kind == MessageType.EVALUATE for _, kind in grid.delivered) == 6
    assert "final_acc/global" not in summary and 0.0 <= summary["final_fed_acc/all"] <= 1.0
    assert (tmp_path / "accuracy.png").is_file()
    _, table = collect([tmp_path])  # the sweep summary reads a run without server figures
    assert table[0]["final_fed_acc/all"] == summary["final_fed_acc/all"]
    assert "final_fed_acc/all" in markdown_table(table)


# ---------------------------------------------------------------------- sBN defects (issue 17)


def test_federated_sbn_falls_back_to_test_batch_statistics_when_no_client_answers(toy_cfg, tmp_path):
    handlers = client_handlers()
    real_query = handlers[MessageType.QUERY]

    def query(msg, context):
        if str(msg.content["config"]["query"]) == "bn-stats":
            raise RuntimeError("no statistics here")
        return real_query(msg, context)

    handlers[MessageType.QUERY] = query
    run(
        LocalGrid(6, handlers),
        toy_cfg("rounds=1 evaluation.bn_stats=federated levels.ratios=[1,0.25]"),
        tmp_path / "fed",
    )
    run(LocalGrid(6, client_handlers()), toy_cfg("rounds=1 levels.ratios=[1,0.25]"), tmp_path / "test_batch")
    (fallback,), (plain,) = _rows(tmp_path / "fed"), _rows(tmp_path / "test_batch")
    assert fallback["bn_stats"] == "test_batch_fallback" and fallback["bn_fallbacks"] == 2  # global + level 0.25
    assert plain["bn_stats"] == "test_batch"
    for key in ("acc/global", "loss/global", "acc/level_0.25"):
        assert fallback[key] == plain[key]


def test_a_last_single_example_batch_counts_in_the_statistics():
    torch.manual_seed(0)
    model = build_model({"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 4})
    x = torch.randn(17, 1, 28, 28)
    data = TensorDataset(x, torch.zeros(17, dtype=torch.long))
    cpu = torch.device("cpu")
    split, whole = bn_sums(model, data, 16, cpu), bn_sums(model, data, 17, cpu)  # 16 + 1 vs one batch
    sixteen = bn_sums(model, TensorDataset(x[:16], torch.zeros(16, dtype=torch.long)), 16, cpu)
    for key in split:
        if key.endswith(".count"):  # every layer saw all 17 examples, not 16
            assert split[key] == whole[key] == sixteen[key] * 17 / 16
    # the first norm layer's input does not depend on the batch: its sums over all 17 agree
    assert torch.allclose(split["bn1.sum"], whole["bn1.sum"], atol=1e-5)
    assert not torch.allclose(split["bn1.sum"], sixteen["bn1.sum"], atol=1e-5)
