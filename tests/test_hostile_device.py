"""A hostile device and a silent one in a real deployment (fedhm_flwr.ops.deploy.loopback's LocalDeployment:
a TLS SuperLink with SuperNode authentication and three `fedhm supernode` devices on loopback).

Partition 0 is the hostile device (``failures.attack.kind=malformed``, a class drawn per reply): its
reply is refused with its reason, over the real transport. The seeded failure injection makes
partition 1 sleep far beyond the round (``failures.slow_seconds``): once the other two answered, the
round stops waiting at the adaptive deadline (``stragglers.*``), records the sleeper as late, and the
run completes. (A sleeping device stays silent in later rounds too, and a round where fewer than the
quorum answer waits for ``timeout``: one round shows the deadline.)"""

from __future__ import annotations

import json

import pytest
from test_deploy import TOY, needs_fmnist

from fedhm_flwr.config import load_config, run_options
from fedhm_flwr.ops.deploy import loopback as dl
from fedhm_flwr.server.simulated_attacks import Attacks, attacker_partitions

JOB = [
    *TOY,
    "num_clients=3",
    "evaluation.deploy_stats=false",
    "failures.attack.kind=malformed",
    "failures.attack.fraction=0.34",
    "failures.slow_probability=0.2",
    "failures.slow_seconds=400",
    "stragglers.min_seconds=10",
    "stragglers.factor=2",
    # this test is about the round's deadline: the sleeper, late after the last round but alive, would
    # otherwise make the run's end wait the whole heartbeat window (62 s) for a verdict that never comes
    "stragglers.verdict_seconds=0",
]


@pytest.mark.slow
@needs_fmnist
def test_a_hostile_device_is_refused_and_a_silent_one_costs_a_round_its_deadline(tmp_path):
    cfg = load_config(JOB)
    assert sorted(attacker_partitions(3, 0.34, int(cfg.seed))) == [0]
    # partition -> what it is made to do
    assert Attacks(run_options(cfg)).injected_failures(1, [0, 1, 2]) == {1: "slow"}
    dep = dl.LocalDeployment(tmp_path / "deploy", say=lambda msg: print(f"[test] {msg}", flush=True))
    names = [f"node-{i}" for i in range(3)]
    try:
        dep.make_credentials(names)
        dep.start_superlink()
        for i, name in enumerate(names):
            dep.register(name)
            dep.start_supernode(name, dl.node_config(i, 3))
        dep.wait_online(names)
        summary = dep.run_job(JOB, tmp_path / "run", timeout=600, echo=False)
    finally:
        dep.close()
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds_completed"] == 1
    reasons = dict(json.loads(row["failure_reasons"]))
    assert list(reasons) == ["p0"] and reasons["p0"] and row["rejected"] == 1 and row["failures"] == 0
    assert json.loads(row["late_nodes"]) == ["p1"] and row["replies"] == 1  # p2's
    # the sleeper cost the round its deadline, 2x the two answers' median time (or 10 s), not the timeout
    # (a device's first answer includes its ClientApp process's start: ~10-25 s here)
    deadline = max(10.0, 2 * row["reply_seconds_median"])
    assert row["reply_seconds_max"] < deadline and row["seconds"] < deadline + 30 < float(cfg.timeout), row
