"""Untrusted clients: attacks, robust aggregation over coverage masks, client-level DP and its accountant."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum

from fedhm_flwr.config import ConfigError, load_config, model_spec, robust_modes
from fedhm_flwr.math import privacy, robust
from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.server_app import initial_state, run
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


# ------------------------------------------------------------------------------------ pure math


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_median_trimmed_and_weighted_mean_over_the_covering_clients_on_known_numbers():
    prev = {"w": _t(-1, -1, -1, -1)}
    # element 0: everyone; 1: clients 0 and 1; 2: client 2 only; 3: nobody
    values = [
        {"w": _t(1, 10, 0, 9)},
        {"w": _t(2, 20, 0, 9)},
        {"w": _t(6, 99, 7, 9)},
        {"w": _t(7, 99, 0, 9)},
        {"w": _t(100, 99, 0, 9)},
    ]
    covers = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    masks = [{"w": torch.tensor(c, dtype=torch.bool)} for c in covers]
    median = robust.combine(prev, values, masks, "median")["w"]
    trimmed = robust.combine(prev, values, masks, "trimmed_mean", trim=0.25)["w"]
    mean = robust.combine(prev, values, masks, "mean", weights=[1, 1, 1, 1, 0])["w"]
    assert median.tolist() == [6, 15, 7, -1]
    assert trimmed.tolist() == [5, 15, 7, -1]  # floor(0.25 * 5) = 1 cut at each end of element 0
    assert mean.tolist() == [4, 15, 7, -1]  # weights renormalised over the covering clients


def test_classifier_rows_count_only_the_clients_holding_the_class():
    state = {"fc.weight": torch.ones(3, 2), "conv.weight": torch.ones(2)}
    mask = robust.with_class_rows(state, None, np.array([True, False, True]), ["fc.weight"])
    assert mask["fc.weight"].tolist() == [[True, True], [False, False], [True, True]]
    assert mask["conv.weight"].all()
    prev = {"fc.weight": torch.zeros(3, 2)}
    values = [{"fc.weight": torch.full((3, 2), 1.0)}, {"fc.weight": torch.full((3, 2), 3.0)}]
    masks = [
        robust.with_class_rows(v, None, np.array(h), ["fc.weight"])
        for v, h in zip(values, ([True, False, False], [True, True, False]))
    ]
    out = robust.combine(prev, values, masks, "median")["fc.weight"]
    assert out[:, 0].tolist() == [2.0, 3.0, 0.0]  # row 2: nobody holds class 2, keeps its value


def test_with_full_coverage_median_and_trimmed_mean_agree_with_flowers_helpers():
    gen = torch.Generator().manual_seed(0)
    values = [{"w": torch.randn(3, 4, generator=gen, dtype=torch.float64)} for _ in range(7)]
    prev = {"w": torch.zeros(3, 4, dtype=torch.float64)}
    stacked = np.stack([v["w"].numpy() for v in values])
    median = robust.combine(prev, values, [None] * 7, "median")["w"]
    trimmed = robust.combine(prev, values, [None] * 7, "trimmed_mean", trim=0.2)["w"]
    np.testing.assert_allclose(median.numpy(), np.median(stacked, axis=0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(trimmed.numpy(), trim_mean(stacked, 0.2), rtol=0, atol=1e-12)


def test_clipping_norms_bounds_and_the_outlier_filter():
    updates = [{"a": _t(3, 4, 100)}, {"a": _t(0.6, 0.8, 0)}]
    masks = [{"a": torch.tensor([True, True, False])}, None]
    norms = robust.update_norms(updates, masks)
    np.testing.assert_allclose(norms, [5.0, 1.0])  # the uncovered 100 does not count
    np.testing.assert_allclose(robust.clip_scales(norms, 2.0), [0.4, 1.0])
    assert robust.quantile_bound([1, 2, 3, 4], 0.5) == 2.5
    keep = robust.outlier_keep([1.0, 1.1, 0.9, 1.05, 0.95, 50.0], 3.0)
    assert keep.tolist() == [True, True, True, True, True, False]
    assert robust.outlier_keep([0.01, 1.0, 1.1, 0.9], 3.0).all()  # small updates are not outliers
    with pytest.raises(ValueError, match="bound"):
        robust.clip_scales(norms, 0.0)


def test_krum_picks_the_reply_closest_to_its_neighbours_as_flower_does():
    vectors = torch.tensor([[0.0], [1.0], [2.0], [10.0]], dtype=torch.float64)
    # n - f - 2 = 2 nearest: scores 1+4, 1+1, 1+4, 64+81
    np.testing.assert_allclose(robust.krum_scores(vectors, 0), [5, 2, 5, 145])
    assert robust.krum_select(vectors, 0) == [1]
    assert robust.krum_select(vectors, 0, m=2) == [1, 0]
    gen = torch.Generator().manual_seed(1)
    points = torch.cat(
        [
            torch.randn(6, 5, generator=gen, dtype=torch.float64),
            100 + torch.randn(2, 5, generator=gen, dtype=torch.float64),
        ]
    )
    contents = [RecordDict({"arrays": ArrayRecord([p.numpy()])}) for p in points]
    (chosen,) = select_multikrum(contents, num_malicious_nodes=2, num_nodes_to_select=1)
    assert robust.krum_select(points, 2) == [next(i for i, c in enumerate(contents) if c is chosen)]


# ------------------------------------------------------------------------------------ accountant


def test_accountant_reproduces_tensorflow_privacys_published_values():
    # tensorflow/privacy rdp_accountant_test.py: test_compute_rdp and test_get_privacy_spent
    # (the latter is the example of Abadi et al.: q = 0.01, sigma = 4, 10000 steps, delta = 1e-5)
    assert privacy.compute_rdp(0.1, 2, 10, [5])[0] == pytest.approx(0.07737, abs=1e-5)
    np.testing.assert_allclose(
        privacy.compute_rdp(0.01, 2.5, 50, [5, 50, 100]), [0.00218075, 0.023846, 167.416307], atol=1e-5
    )
    orders = list(range(2, 33))
    eps, order = privacy.epsilon_from_rdp(privacy.compute_rdp(0.01, 4, 10000, orders), 1e-5, orders)
    assert eps == pytest.approx(1.258575, abs=1e-5) and order == 20


def test_epsilon_grows_with_rounds_and_shrinks_with_the_noise_multiplier():
    def eps(rounds, sigma, q=0.5):
        acc = privacy.RdpAccountant()
        acc.step(q, sigma, rounds)
        return acc.epsilon(1e-5)

    assert 0 < eps(1, 1.0) < eps(10, 1.0) < eps(100, 1.0)
    assert eps(10, 0.7) > eps(10, 1.0) > eps(10, 2.0) > eps(10, 4.0) > 0
    assert privacy.RdpAccountant().epsilon(1e-5) == 0.0


# ------------------------------------------------------------------------------------ rounds


def _trained_round(cfg, num_nodes=None):
    """One round's configured messages and replies on the in-process grid."""
    spec = model_spec(cfg)
    strategy = STRATEGIES[cfg.method.name](cfg, spec)
    state = strategy.method.initial_state(int(cfg.seed))
    state = initial_state(cfg, spec) if state is None else state
    grid = LocalGrid(num_nodes or int(cfg.num_clients), client_handlers())
    messages = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid))
    return strategy, state, grid, messages, list(grid.send_and_receive(messages))


def _aggregate(cfg, state, grid, replies):
    """The same round aggregated by a fresh strategy of ``cfg`` (same payloads, no training)."""
    strategy = STRATEGIES[cfg.method.name](cfg, model_spec(cfg))
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
    attackers = {n for n in strategy.sent if strategy.is_attacker(n)}
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
    attackers = {n for n in strategy.sent if strategy.is_attacker(n)}
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
    valid = [noisy_strategy._validate(m.metadata.src_node_id, m)[0] for m in replies]
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


# ------------------------------------------------------------------------------------ hostile numbers


def test_defences_never_select_or_produce_inf_nan_or_huge_values():
    honest = [_t(1.0, 2.0), _t(1.1, 2.1), _t(0.9, 1.9), _t(1.05, 2.05), _t(0.95, 1.95)]
    hostile = [_t(math.inf, -math.inf), _t(math.nan, math.nan), _t(1e20, -1e20), _t(1e200, 1e200)]
    rows = torch.stack(honest + hostile)
    scores = robust.krum_scores(rows, f=4)
    assert np.isinf(scores[[5, 6, 8]]).all() and np.isfinite(scores[:5]).all()
    picked = robust.krum_select(rows, f=4, m=9)
    assert set(picked) == {0, 1, 2, 3, 4, 7}  # never inf, NaN or the overflowing 1e200 (1e20 only when m asks for it)
    assert robust.krum_select(rows, f=4, m=5) == sorted(range(5), key=lambda i: (scores[i], i))
    assert robust.krum_select(torch.stack(hostile[:2]), f=0) == []
    prev = {"w": _t(0.0, 0.0)}
    values = [{"w": v} for v in honest + hostile]
    for rule, kwargs in (("median", {}), ("trimmed_mean", {"trim": 0.3}), ("mean", {"weights": [1] * 7})):
        out = robust.combine(prev, values[:5] + values[5:7], [None] * 7, rule, **kwargs)["w"]
        assert torch.isfinite(out).all()  # inf and NaN cover nothing
        if rule != "mean":
            out = robust.combine(prev, values, [None] * 9, rule, **kwargs)["w"]
            assert 0.9 <= float(out[0]) <= 1.1 and 1.9 <= float(out[1]) <= 2.1  # 1e20, 1e200 cut away
    norms = robust.update_norms([{"w": v} for v in honest[:1] + hostile], [None] * 5)
    scales = robust.clip_scales(norms, 1.0)
    assert scales[1] == 0 and scales[2] == 0 and scales[4] == 0 and 0 < scales[3] < 1e-19
    assert np.isfinite(robust.quantile_bound(norms, 0.5))  # the adaptive bound ignores inf/NaN
    assert robust.oversized({"w": _t(1e20, 0)}, 1e6).startswith("w has L2 norm")
    assert robust.oversized({"w": _t(math.inf, 0)}, 1e6) == "w holds NaN or Inf"
    assert robust.oversized({"w": _t(3, 4), "n": torch.tensor([10**9])}, 5.0) is None


def test_the_screens_one_op_pass_over_a_whole_reply_clears_only_what_the_per_tensor_passes_clear():
    """``flat`` (all of a reply's floating values) clears a reply at once only when its whole norm is
    within the bound; otherwise the per-tensor passes decide, with the same reasons as without it."""
    within = {"a": _t(3.0, 0.0), "b": _t(0.0, 4.0)}  # each norm <= 4, the whole's 5
    flat = torch.cat([v.reshape(-1) for v in within.values()])
    assert robust.oversized(within, 5.0, flat) is None
    assert robust.oversized(within, 4.5, flat) is None  # whole 5 > 4.5: the per-tensor pass clears it
    assert robust.oversized(within, 3.5, flat) == "b has L2 norm 4, above the bound 3.5 (aggregation.max_norm)"
    for bad in (math.nan, math.inf, -math.inf):
        state = {"a": _t(1.0, 0.0), "b": _t(0.0, bad)}
        flat = torch.cat([v.reshape(-1) for v in state.values()])
        assert robust.oversized(state, 1e6, flat) == "b holds NaN or Inf"
    big = {"a": _t(3e30, 0.0)}  # float32 squares overflow to inf: not cleared by the one op
    assert robust.oversized(big, 1e15, big["a"]).startswith("a has L2 norm 3e+30")
    assert robust.oversized({}, 1.0, torch.zeros(0)) is None


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
    valid = [strategy._validate(m.metadata.src_node_id, m)[0] for m in replies if m.metadata.src_node_id != bad]
    broken = dataclasses.replace(valid[0], state={k: v.clone() for k, v in valid[0].state.items()})
    next(v for v in broken.state.values() if v.is_floating_point()).view(-1)[0] = math.inf
    strategy.untrusted.rejected.clear()
    new = strategy.untrusted.merge(1, state, valid[1:] + [broken])
    assert strategy.untrusted.rejected == [(broken.node_id, "recovered update holds NaN or Inf")]
    assert all(torch.isfinite(new[k]).all() for k in new if new[k].is_floating_point())
