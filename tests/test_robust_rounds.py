"""Untrusted clients in rounds: attacks, robust aggregation and client-level DP on the in-process
grid, every method with each defence it accepts, refused settings and huge replies. The pure math is
in tests/test_robust.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

from fedhm_flwr.config import ConfigError, load_config, model_spec, robust_modes, run_options
from fedhm_flwr.math import privacy, robust
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state, run
from fedhm_flwr.server.registry import STRATEGIES

TOY = (
    "num_clients=6 fraction_train=1.0 dataset.max_train_examples=1200 dataset.max_test_examples=300 "
    "model.width=4 train.batch_size=64 evaluation.batch_size=300"
)
TINY_IMAGE = (
    "model=vit dataset=fashion_mnist model.backbone=random model.width=16 model.depth=2 "
    "num_clients=4 fraction_train=1.0 dataset.max_train_examples=400 dataset.max_test_examples=100 "
    "train.batch_size=32 evaluation.batch_size=100"
)


# ------------------------------------------------------------------------------------ rounds


def _trained_round(cfg, num_nodes=None):
    """One round's configured messages and replies on the in-process grid."""
    spec = model_spec(cfg)
    strategy = STRATEGIES[cfg.method.name](run_options(cfg), spec)
    state = strategy.method.initial_state(int(cfg.seed))
    state = initial_state(cfg.seed, spec) if state is None else state
    grid = LocalGrid(num_nodes or int(cfg.num_clients), client_handlers())
    messages = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid))
    return strategy, state, grid, messages, list(grid.send_and_receive(messages))


def _aggregate(cfg, state, grid, replies):
    """The same round aggregated by a fresh strategy of ``cfg`` (same payloads, no training)."""
    strategy = STRATEGIES[cfg.method.name](run_options(cfg), model_spec(cfg))
    list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid))
    arrays, _ = strategy.aggregate_train(1, replies)
    return strategy, arrays.to_torch_state_dict()


def _distance(a, b):
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))


@pytest.fixture(scope="module")
def scaled_round():
    """FedHM, 6 clients of 4 levels, one of them (20 %) sending 100 x its update."""
    cfg = load_config(f"{TOY} failures.attack.kind=scale failures.attack.fraction=0.2")
    strategy, state, grid, _, replies = _trained_round(cfg)
    attackers = {n for n in strategy.wire.sent if strategy.wire.is_attacker(n)}
    return cfg, state, grid, replies, attackers


@pytest.fixture(scope="module")
def clean_replies():
    """The replies of the toy FedHM round without attack."""
    return _trained_round(load_config(TOY))[4]


@pytest.mark.parametrize("kind", ["scale", "sign_flip", "gaussian", "label_flip"])
def test_an_attack_changes_exactly_the_chosen_clients_replies_in_the_chosen_way(kind, clean_replies):
    cfg = load_config(f"{TOY} failures.attack.kind={kind} failures.attack.fraction=0.34 failures.attack.scale=7")
    clean = clean_replies
    strategy, _, _, messages, attacked = _trained_round(cfg)
    attackers = {n for n in strategy.wire.sent if strategy.wire.is_attacker(n)}
    assert len(attackers) == 2  # round(0.34 * 6) partitions, fixed for the run
    assert json.loads(strategy.attacks.columns["attackers"]) == sorted(
        (strategy.node_label(n) for n in attackers), key=lambda s: int(s[1:])
    )
    received = {m.metadata.dst_node_id: m.content["arrays"].to_torch_state_dict() for m in messages}
    clean_by = {m.metadata.src_node_id: m for m in clean}
    for reply in attacked:
        node = reply.metadata.src_node_id
        got, honest = (
            reply.content["arrays"].to_torch_state_dict(),
            clean_by[node].content["arrays"].to_torch_state_dict(),
        )
        if node not in attackers:
            assert all(torch.equal(got[k], honest[k]) for k in got)
            continue
        sent = received[node]
        update = {k: honest[k].double() - sent[k].double() for k in got}
        sent_update = {k: got[k].double() - sent[k].double() for k in got}
        if kind == "scale":
            assert all(torch.allclose(sent_update[k], 7 * update[k], atol=1e-5) for k in got)
        elif kind == "sign_flip":
            assert all(torch.allclose(sent_update[k], -update[k], atol=1e-6) for k in got)
        elif kind == "gaussian":
            norm = math.sqrt(sum(float((u**2).sum()) for u in update.values()))
            assert math.sqrt(sum(float((u**2).sum()) for u in sent_update.values())) == pytest.approx(norm, rel=1e-4)
            assert _distance(sent_update, update) > 0.5 * norm
        else:  # label_flip: trained on y -> C - 1 - y, reported counts follow
            counts = list(reply.content["metrics"]["class-counts"])
            assert counts == list(clean_by[node].content["metrics"]["class-counts"])[::-1]
            assert _distance(got, honest) > 0


@pytest.mark.parametrize("defence", ["clip", "median", "trimmed_mean"])
def test_a_defence_removes_a_scaled_replys_influence(scaled_round, defence):
    _, state, grid, replies, attackers = scaled_round
    assert len(attackers) == 1
    honest = [r for r in replies if r.metadata.src_node_id not in attackers]
    dist = {}
    for mode in ("none", defence):
        cfg = load_config(f"{TOY} aggregation.robust={mode}")
        _, with_attacker = _aggregate(cfg, state, grid, replies)
        _, without = _aggregate(cfg, state, grid, honest)
        dist[mode] = _distance(with_attacker, without)
    assert dist["none"] > 1.0  # the x100 update dominates the plain average
    assert dist[defence] < 0.05 * dist["none"]


def test_the_outlier_filter_rejects_and_counts_the_scaled_reply_and_krum_never_picks_it(scaled_round):
    _, state, grid, replies, attackers = scaled_round
    honest = [r for r in replies if r.metadata.src_node_id not in attackers]
    cfg = load_config(f"{TOY} aggregation.outlier_z=3")
    strategy, filtered = _aggregate(cfg, state, grid, replies)
    assert strategy.untrusted.columns["robust_rejected"] == 1
    assert json.loads(strategy.untrusted.columns["robust_rejected_nodes"]) == [
        strategy.node_label(n) for n in attackers
    ]
    _, clean = _aggregate(load_config(TOY), state, grid, honest)
    assert all(torch.equal(filtered[k], clean[k]) for k in clean)
    strategy, _ = _aggregate(load_config(f"{TOY} aggregation.robust=krum aggregation.krum_m=3"), state, grid, replies)
    picked = json.loads(strategy.untrusted.columns["krum_selected"])
    assert len(picked) == 3 and not {strategy.node_label(n) for n in attackers} & set(picked)
    assumed = []  # Krum's f: the configured fraction of the round's replies, rounded up
    real = robust.krum_select
    robust.krum_select = lambda vectors, f, m=1: assumed.append((len(vectors), f)) or real(vectors, f, m)
    try:
        for fraction in (0.1, 0.34, 0.49):
            _aggregate(
                load_config(f"{TOY} aggregation.robust=krum aggregation.krum_fraction={fraction}"), state, grid, replies
            )
    finally:
        robust.krum_select = real
    assert assumed == [(6, 1), (6, 3), (6, 3)]


METHODS = {
    "fedhm": "",
    "heterofl": "method=heterofl",
    "fedrolex": "method=fedrolex",
    "fedavg": "method=fedavg method.variant=smallest method.family=heterofl",
    "prism": "method=prism",
    "fedlora": f"method=fedlora {TINY_IMAGE} method.max_rank=4",
    "heterotune": f"method=heterotune {TINY_IMAGE} levels.ratios=[1,0.5] levels.proportions=[1,1] method.bottleneck=8",
}


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_a_round_with_each_defence_it_accepts(method):
    base = METHODS[method] if "model=vit" in METHODS[method] else f"{TOY} {METHODS[method]}"
    cfg = load_config(base)
    _, state, grid, _, replies = _trained_round(cfg)
    _, plain = _aggregate(cfg, state, grid, replies)
    modes = robust_modes(cfg)
    for mode in modes:
        for extra in ("", "aggregation.outlier_z=2"):
            _, new = _aggregate(load_config(f"{base} aggregation.robust={mode} {extra}"), state, grid, replies)
            assert new.keys() == state.keys()
            assert all(new[k].shape == state[k].shape and torch.isfinite(new[k]).all() for k in new)
    if "clip" in modes:  # a bound no update reaches: exactly the method's own weighted merge
        _, unclipped = _aggregate(
            load_config(f"{base} aggregation.robust=clip aggregation.clip_norm=1e9"), state, grid, replies
        )
        for k in plain:
            torch.testing.assert_close(unclipped[k], plain[k], rtol=1e-5, atol=1e-6)
    else:
        assert method in ("prism", "heterotune")


def test_dp_adds_calibrated_noise_to_the_clipped_mean_and_reports_epsilon(tmp_path):
    base = f"{TOY} fraction_train=0.9 dp.enabled=true dp.clip=0.5 dp.seed=3"  # the same sample twice
    cfg = load_config(f"{base} dp.noise_multiplier=1.0")
    _, state, grid, messages, replies = _trained_round(cfg)
    assert messages  # Poisson sampling, q = 0.9 over 6 nodes
    noisy_strategy, noisy = _aggregate(cfg, state, grid, replies)
    valid = [noisy_strategy.wire.validate(m.metadata.src_node_id, m)[0] for m in replies]
    mean, scales = privacy.dp_mean(state, [noisy_strategy.method.recovered(r, state)[0] for r in valid], 0.5, 0.9 * 6)
    noise = torch.cat([(noisy[k].double() - mean[k].double()).flatten() for k in state if state[k].is_floating_point()])
    columns = noisy_strategy.untrusted.columns
    assert columns["dp_noise_std"] == pytest.approx(1.0 * 0.5 / (0.9 * 6))  # sigma C / m, m = q x clients
    assert float(noise.std()) == pytest.approx(columns["dp_noise_std"], rel=0.05)
    assert columns["dp_clipped"] == int((scales < 1).sum()) and columns["dp_q"] == 0.9
    assert columns["dp_epsilon"] == pytest.approx(privacy.epsilon_from_rdp(privacy.compute_rdp(0.9, 1.0, 1), 1e-5)[0])
    summary = run(LocalGrid(6, client_handlers()), load_config(f"{base} rounds=2"), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[0]["dp_epsilon"] < rows[1]["dp_epsilon"] == summary["dp_epsilon"]


@pytest.mark.parametrize(
    "override,field",
    [
        ("aggregation.robust=krum method=heterofl", "aggregation.robust"),
        ("aggregation.robust=median method=prism", "aggregation.robust"),
        ("aggregation.robust=mean", "aggregation.robust"),
        ("aggregation.trim_fraction=0.5", "aggregation.trim_fraction"),
        ("failures.attack.kind=backdoor", "failures.attack.kind"),
        ("failures.attack.fraction=1.5", "failures.attack.fraction"),
        ("dp.enabled=true method=heterofl", "dp.enabled"),
        ("dp.enabled=true aggregation.robust=median", "aggregation.robust"),
        ("dp.noise_multiplier=0", "dp.noise_multiplier"),
    ],
)
def test_bad_untrusted_settings_are_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(f"{TOY} {override}")
    assert err.value.field == field


def _huge_factors(reply, factor):
    """The reply with every factor (``.a.weight``/``.b.weight``) multiplied by ``factor``."""
    state = reply.content["arrays"].to_torch_state_dict()
    state = {k: v * factor if k.endswith((".a.weight", ".b.weight")) else v for k, v in state.items()}
    reply.content = RecordDict(
        {"arrays": ArrayRecord.from_torch_state_dict(state), "metrics": reply.content["metrics"]}
    )
    return reply


@pytest.fixture(scope="module")
def huge_round():
    """The toy FedHM round with one low-rank reply's factors x1e20 (finite in float32; their product
    is not)."""
    cfg = load_config(TOY)
    _, state, grid, _, replies = _trained_round(cfg)
    low = next(r for r in replies if any(k.endswith(".b.weight") for k in r.content["arrays"]))
    _huge_factors(low, 1e20)
    return state, grid, replies, low.metadata.src_node_id


@pytest.mark.parametrize("mode", ["none", "clip", "median", "trimmed_mean", "krum", "dp"])
def test_a_reply_of_huge_factors_is_rejected_and_counted_and_every_defence_stays_finite(huge_round, mode):
    state, grid, replies, bad = huge_round
    cfg = load_config(f"{TOY} " + ("dp.enabled=true" if mode == "dp" else f"aggregation.robust={mode}"))
    strategy, new = _aggregate(cfg, state, grid, replies)
    assert [n for n, _ in strategy.round_log.rejected] == [bad]
    assert "above the bound 1e+06 (aggregation.max_norm)" in strategy.round_log.rejected[0][1]
    assert strategy._round_row(1, None)["rejected"] == 1
    assert all(torch.isfinite(new[k]).all() for k in new if new[k].is_floating_point())
    if mode == "none":
        return
    # past the screen (a method whose recovery could overflow): the merge refuses the update itself
    valid = [strategy.wire.validate(m.metadata.src_node_id, m)[0] for m in replies if m.metadata.src_node_id != bad]
    broken = dataclasses.replace(valid[0], state={k: v.clone() for k, v in valid[0].state.items()})
    next(v for v in broken.state.values() if v.is_floating_point()).view(-1)[0] = math.inf
    strategy.untrusted.rejected.clear()
    new = strategy.untrusted.merge(1, state, valid[1:] + [broken])
    assert strategy.untrusted.rejected == [(broken.node_id, "recovered update holds NaN or Inf")]
    assert all(torch.isfinite(new[k]).all() for k in new if new[k].is_floating_point())
