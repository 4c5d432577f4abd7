"""Nothing a device sends can stop, stall or poison the federation (docs/ROBUSTNESS.md, "Malformed
replies"): every class of malformed reply of fedhm_flwr/client/hostile.py is refused with its reason
by the real strategy, a short fuzzing campaign (Hypothesis drawing bench/fuzz.py's rounds) finds no
escaping exception and no non-finite model, and the issue's rows go through the real ServerApp run
on the in-process grid without changing the model the honest nodes make."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType
from hypothesis import HealthCheck, given, settings, strategies as st
from inprocess_helpers import SERVER_THREADS

from bench import fuzz
from fedhm_flwr.client import handlers as base
from fedhm_flwr.client.hostile import BENIGN, MUTATIONS, malformed
from fedhm_flwr.core.attack_kinds import MALFORMED_KINDS
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.reporting.results import load_checkpoint

#: what the refusal of each class must say (written from the protocol, not from the code's messages)
REASONS = {
    "int-arrays": "int64",
    "float64-array": "float64",
    "lying-shape": "bytes",
    "wrong-shape": "shape",
    "oversized-bytes": "bytes",
    "truncated-bytes": "bytes",
    "bad-header": "bytes",
    "fortran-order": "Fortran",
    "other-stype": "torch.Tensor",
    "nan-values": "NaN",
    "inf-values": "Inf",
    "huge-values": "max_norm",
    "extra-key": "rogue.weight",
    "missing-key": "missing",
    "inf-examples": "num-examples",
    "nan-examples": "num-examples",
    "fractional-examples": "num-examples",
    "float-examples": "num-examples",
    "huge-examples": "reported when it joined",
    "zero-examples": "num-examples",
    "negative-examples": "num-examples",
    "missing-examples": "num-examples",
    "list-examples": "num-examples",
    "nan-counts": "class-counts",
    "short-counts": "class-counts",
    "float-counts": "class-counts",
    "negative-counts": "class-counts",
    "counts-off": "class-counts",
    "nan-loss": "train-loss",
    "inf-seconds": "seconds",
    "accuracy-above-1": "train-accuracy",
    "other-level": "level",
    "extra-metric": "weight",
    "extra-record": "config",
    "missing-metrics": "metrics",
    "missing-arrays": "arrays",
    "metrics-as-config": "MetricRecord",
}


@pytest.fixture(scope="module")
def federations():
    """FedHM undefended, FedHM with clipping, sample-weighted FedAvg: honest replies trained once each."""
    made: dict[str, fuzz.Federation] = {}

    def get(name: str) -> fuzz.Federation:
        if name not in made:
            made[name] = fuzz.Federation.make(name, fuzz.CONFIGS[name])
        return made[name]

    return get


def test_every_class_is_named_and_applies_to_an_honest_reply(federations):
    assert set(REASONS) == set(MALFORMED_KINDS) == set(MUTATIONS) - BENIGN
    for name in ("fedhm none", "fedhm bfloat16"):  # (bfloat16 travels as int16 bits)
        content = next(iter(federations(name).honest.values()))
        for kind in MUTATIONS:
            changed = MUTATIONS[kind][1](content, np.random.default_rng(0))
            assert changed is not content, kind


@pytest.mark.parametrize("name", ["fedhm none", "fedavg", "fedhm bfloat16"])
@pytest.mark.parametrize("kind", sorted(MUTATIONS))
def test_each_class_is_refused_with_its_reason_and_the_rest_aggregate(federations, name, kind):
    fed = federations(name)
    node = sorted(fed.honest)[2]
    twin = copy.deepcopy(fed)  # the same round without that node's reply, or with its honest one
    outcome = fuzz.fuzz_round(fed, fuzz.Plan(kinds={node: [kind]}))
    assert outcome.escaped is None and outcome.finite
    reasons = [why for n, why in outcome.rejected if n == node]
    if kind in BENIGN:  # an honest reply written another way is accepted, and counts as the honest one
        assert reasons == [] and outcome.accepted == len(fed.honest)
        fuzz.fuzz_round(twin, fuzz.Plan())
    else:
        assert len(reasons) == 1 and REASONS[kind] in reasons[0], reasons
        assert outcome.accepted == len(fed.honest) - 1 and len(outcome.rejected) == 1
        fuzz.fuzz_round(twin, fuzz.Plan(delivery={node: "never"}))
    assert fuzz.check_round(fed, outcome) == []
    mine, theirs = fed.strategy.global_state, twin.strategy.global_state
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # the refused reply left no trace


def test_duplicate_unsolicited_failed_and_missing_replies_are_each_counted_once(federations):
    fed = federations("fedhm none")
    nodes = sorted(fed.honest)
    plan = fuzz.Plan(delivery={nodes[0]: "twice", nodes[1]: "unsolicited", nodes[2]: "never", nodes[3]: "error"})
    outcome = fuzz.fuzz_round(fed, plan)
    assert fuzz.check_round(fed, outcome) == []
    assert sorted(n for n, _ in outcome.rejected) == sorted(nodes[:2]) and len(outcome.failures) == 1
    assert outcome.accepted == len(nodes) - 2  # the duplicated reply counts once, the stray not at all
    assert fed.strategy.round_log.late == [nodes[2]]


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_fuzzed_rounds_never_raise_never_leave_a_non_finite_model_and_count_every_refusal(federations, data):
    fed = federations(data.draw(st.sampled_from(["fedhm none", "fedhm clip", "fedavg"])))
    plan = fuzz.Plan(seed=data.draw(st.integers(0, 2**31 - 1)))
    for node in sorted(fed.honest):
        plan.kinds[node] = sorted(
            set(data.draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=2))), key=lambda k: (k not in BENIGN, k)
        )
        plan.delivery[node] = data.draw(st.sampled_from(fuzz.DELIVERIES))
    outcome = fuzz.fuzz_round(fed, plan)
    assert fuzz.check_round(fed, outcome) == []


# ------------------------------------------------------------------ the issue's rows, through the ServerApp

#: partition -> what it does: a malformed class, "twice" (its reply delivered twice) or "silent"
ROWS = {
    0: "int-arrays",
    1: "lying-shape",
    2: "inf-examples",
    3: "fractional-examples",
    4: "huge-examples",
    5: "twice",
    6: "silent",
}


class _Twice(LocalGrid):
    """A grid (not the SuperLink's) that delivers partition 5's training replies twice."""

    def pull_messages(self, message_ids):
        out = []
        for reply in super().pull_messages(message_ids):
            out.append(reply)
            node = self.contexts.get(reply.metadata.src_node_id)
            if node is not None and node.node_config["partition-id"] == 5 and reply.metadata.message_type == "train":
                out.append(reply)
        return out


def _hostile_handlers(crash_instead: bool):
    """The project's handlers, the partitions of ROWS hostile (or, ``crash_instead``, crashing)."""
    handlers = client_handlers()

    def train(msg, context):
        role = ROWS.get(int(context.node_config["partition-id"]), "honest")
        if role in ("honest", "twice"):
            return base.handle_train(msg, context)
        if crash_instead:
            raise RuntimeError("crashed instead")
        if role == "silent":
            return None  # never answers
        reply = base.handle_train(msg, context)
        return Message(malformed(reply.content, role, np.random.default_rng(0)), reply_to=msg)

    handlers[MessageType.TRAIN] = train
    return handlers


@pytest.mark.parametrize("method", ["method=fedavg", "aggregation.robust=clip"])
def test_the_issue_s_rows_are_refused_and_the_honest_nodes_model_is_unchanged(toy_cfg, tmp_path, method):
    cfg = toy_cfg(
        f"num_clients=10 rounds=2 {method} evaluation.levels=false evaluation.deploy_stats=false "
        "stragglers.min_seconds=2"
    )
    assert float(cfg.timeout) == 600  # the default: a silent node must not cost it
    hostile = _run(cfg, tmp_path / "hostile", crash_instead=False)
    crashed = _run(cfg, tmp_path / "crashed", crash_instead=True)
    rows = [json.loads(line) for line in (tmp_path / "hostile" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        reasons = dict(json.loads(row["failure_reasons"]))
        assert "int64" in reasons["p0"] and "bytes" in reasons["p1"]
        assert "num-examples is float" in reasons["p2"] and "num-examples is float" in reasons["p3"]
        assert "reported when it joined" in reasons["p4"] and reasons["p5"].startswith("duplicate reply")
        assert json.loads(row["late_nodes"]) == ["p6"] and row["replies"] == 4
        assert row["seconds"] < 60  # the silent node cost the adaptive deadline (2 s here), not the 600 s timeout
    assert hostile["rounds_completed"] == 2
    mine, theirs = load_checkpoint(tmp_path / "hostile")[0], load_checkpoint(tmp_path / "crashed")[0]
    assert all(torch.isfinite(v).all() for v in mine.values() if v.is_floating_point())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert crashed["rounds_completed"] == 2


def _run(cfg, out, crash_instead: bool):
    """The real ServerApp run on the grid of partition 5's double delivery (as inprocess_helpers runs)."""
    grid = _Twice(int(cfg.num_clients), _hostile_handlers(crash_instead))
    before = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS)
    try:
        return run(grid, cfg, out)
    finally:
        torch.set_num_threads(before)
