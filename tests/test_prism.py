"""PriSM / OrthDrop: sampling statistics, sub-layer exactness, per-kernel aggregation, refresh,
the U-subset option, and whole rounds through the shared base (in process)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, MessageType
from reply_helpers import reply

from fedhm_flwr.config import ConfigError, load_config, model_spec, resume_config, run_options
from fedhm_flwr.math import prism
from fedhm_flwr.models import build_model
from fedhm_flwr.models.layers import PrismConv2d, PrismLinear
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state, run
from fedhm_flwr.ops.tools.cost_table import format_table, level_rows
from fedhm_flwr.reporting.results import load_checkpoint
from fedhm_flwr.server.registry import PriSMStrategy

SIGMA = torch.tensor([4.0, 3.0, 2.0, 1.5, 1.0, 0.5], dtype=torch.float64)

# Statistical tolerance of the frequency tests: every empirical frequency lies within 5 standard
# errors sqrt(p(1-p)/N) of its exact probability (N = 5000 seeded draws). For a correct sampler a
# single index leaves that band with probability ~6e-7 (normal approximation), so the test is
# deterministic in practice (the seed is fixed), while a wrong distribution cannot pass: sigma^1
# instead of sigma^2.5 moves p_0 by 0.23 (> 30 standard errors), and drawing the inclusion
# probabilities as count * p instead of successive sampling moves them by > 0.05 (> 6 SE).
DRAWS, Z = 5000, 5.0


def _within_band(freq: np.ndarray, p: np.ndarray, n: int) -> bool:
    se = np.sqrt(p * (1 - p) / n)
    return bool(np.all(np.abs(freq - p) <= Z * se + 1e-12))


# ------------------------------------------------------------------------------- sampling


def test_probabilities_are_sigma_to_the_kappa_uniform_or_softmax():
    p = prism.sampling_probabilities(SIGMA, "prism", 2.5)
    expected = SIGMA.numpy() ** 2.5 / (SIGMA.numpy() ** 2.5).sum()
    assert np.allclose(p, expected, rtol=1e-12) and math.isclose(p.sum(), 1.0)
    assert np.allclose(prism.sampling_probabilities(SIGMA, "uniform"), 1 / 6)
    soft = np.exp(SIGMA.numpy()) / np.exp(SIGMA.numpy()).sum()
    assert np.allclose(prism.sampling_probabilities(SIGMA, "softmax"), soft, rtol=1e-12)
    assert np.allclose(prism.sampling_probabilities(torch.zeros(4), "prism", 2.5), 0.25)  # all-zero layer
    with pytest.raises(ValueError):
        prism.sampling_probabilities(SIGMA, "orthdrop")


@pytest.mark.parametrize("sampling,kappa", [("prism", 2.5), ("softmax", 1.0), ("uniform", 1.0)])
def test_single_draw_frequencies_match_p(sampling, kappa):
    p = prism.sampling_probabilities(SIGMA, sampling, kappa)
    rng = np.random.default_rng(1234)
    hits = np.zeros(len(SIGMA))
    for _ in range(DRAWS):
        hits[int(prism.draw(len(SIGMA), 1, sampling, rng, p))] += 1
    assert _within_band(hits / DRAWS, p, DRAWS)


def _inclusion_probabilities(p: np.ndarray, count: int) -> np.ndarray:
    """Exact P(i in sample) of successive sampling without replacement (all ordered sequences)."""
    out = np.zeros(len(p))
    for seq in itertools.permutations(range(len(p)), count):
        prob, left = 1.0, 1.0
        for i in seq:
            prob *= p[i] / left
            left -= p[i]
        out[list(seq)] += prob
    return out


def test_draws_without_replacement_match_exact_inclusion_probabilities():
    p = prism.sampling_probabilities(SIGMA, "prism", 2.5)
    rng = np.random.default_rng(99)
    hits = np.zeros(len(SIGMA))
    for _ in range(DRAWS):
        picked = prism.draw(len(SIGMA), 3, "prism", rng, p)
        assert picked.tolist() == sorted(set(picked.tolist())) and len(picked) == 3  # distinct, sorted
        hits[picked.numpy()] += 1
    exact = _inclusion_probabilities(p, 3)
    assert math.isclose(exact.sum(), 3.0)
    assert _within_band(hits / DRAWS, exact, DRAWS)
    assert np.abs(exact - np.minimum(3 * p, 1)).max() > 6 * np.sqrt(0.25 / DRAWS)  # not count * p: the test can tell


def test_draws_are_seeded_and_orthdrop_is_top_k():
    p = prism.sampling_probabilities(SIGMA, "uniform")
    a = [prism.draw(6, 3, "uniform", np.random.default_rng(7), p).tolist() for _ in range(2)]
    b = [prism.draw(6, 3, "uniform", np.random.default_rng(s), p).tolist() for s in range(8, 16)]
    assert a[0] == a[1] and any(x != a[0] for x in b)
    assert prism.draw(6, 3, "orthdrop").tolist() == [0, 1, 2]
    # fewer positive probabilities than kernels to draw: all positive ones, the rest among the zeros
    picked = prism.draw(4, 3, "prism", np.random.default_rng(0), np.array([0.5, 0.5, 0.0, 0.0]))
    assert {0, 1} <= set(picked.tolist()) and len(picked) == 3


def test_keep_count_is_ceil_of_keep_times_R():
    assert prism.keep_count(64, 0.2) == 13  # 12.8
    assert prism.keep_count(10, 0.7) == 7  # 0.7 * 10 = 7.000000000000001 in floating point
    assert prism.keep_count(10, 0.2) == 2 and prism.keep_count(3, 0.01) == 1 and prism.keep_count(5, 1.0) == 5
    assert prism.num_kernels((16, 8, 3, 3)) == 16 and prism.num_kernels((64, 4, 3, 3)) == 36
    with pytest.raises(ValueError):
        prism.keep_count(10, 0.0)


# ------------------------------------------------------------------------------- sub-layers


def _load(layer, factored, sample):
    u, v = prism.slice_layer(factored, sample)
    layer.load_state_dict({**layer.state_dict(), "u.weight": u, "v.weight": v})
    return layer


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (1, 0), (2, 0)])
def test_a_sub_layer_with_every_kernel_is_the_original_conv(stride, padding):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(5, 7, 3, stride, padding, bias=False)
    factored = prism.decompose(conv.weight)
    assert factored.U.shape == (7, 7) and factored.Vh.shape == (7, 45)  # (n, m k k) unrolling, R = min
    layer = _load(PrismConv2d.like(conv, 7), factored, prism.Draw(torch.arange(7)))
    x = torch.randn(2, 5, 9, 9)
    assert torch.allclose(layer(x), conv(x), atol=1e-5)


def test_a_sub_layer_computes_exactly_its_sampled_kernels():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(4, 6, 3, 1, 1, bias=True)
    factored = prism.decompose(conv.weight)
    kernels = torch.tensor([0, 2, 5])
    layer = _load(PrismConv2d.like(conv, 3), factored, prism.Draw(kernels))
    with torch.no_grad():
        layer.bias.copy_(conv.bias)
    partial = sum(factored.S[i] * torch.outer(factored.U[:, i], factored.Vh[i]) for i in kernels.tolist())
    x = torch.randn(2, 4, 8, 8)
    expected = F.conv2d(x, prism.fold(partial, conv.weight.shape).float(), conv.bias, padding=1)
    assert torch.allclose(layer(x), expected, atol=1e-5)
    assert set(layer.state_dict()) == {"bias", "v.weight", "u.weight"}


def test_linear_sub_layer_and_its_frobenius_term():
    torch.manual_seed(2)
    linear = torch.nn.Linear(12, 5)
    factored = prism.decompose(linear.weight)
    layer = _load(PrismLinear.like(linear, 5), factored, prism.Draw(torch.arange(5)))
    with torch.no_grad():
        layer.bias.copy_(linear.bias)
    x = torch.randn(3, 12)
    assert torch.allclose(layer(x), linear(x), atol=1e-5)
    assert torch.isclose(layer.frobenius_sq(), linear.weight.pow(2).sum(), rtol=1e-5)


# ------------------------------------------------------------------------------- aggregation and refresh


def test_per_kernel_aggregation_conserves():
    torch.manual_seed(3)
    factored = prism.decompose(torch.randn(6, 2, 3, 3))  # R = 6 kernels, 18 columns
    U0, V0 = prism.scaled_factors(factored)
    draws = [
        prism.Draw(torch.tensor([0, 1, 3])),
        prism.Draw(torch.tensor([0, 3, 4])),
        prism.Draw(torch.tensor([0, 1]), rows=torch.tensor([1, 4])),
    ]  # the third computes rows 1 and 4
    replies = []
    for d in draws:
        rows = d.rows if d.rows is not None else torch.arange(6)
        u = U0[rows][:, d.kernels] + torch.randn(len(rows), len(d.kernels))
        v = V0[d.kernels] + torch.randn(len(d.kernels), 18)
        replies.append((d, u, v))
    U, V = prism.aggregate_kernels(factored, replies)

    def mean_v(i):
        return torch.stack([v[d.kernels.tolist().index(i)] for d, _, v in replies if i in d.kernels]).mean(0)

    for i, sampled_by in {0: 3, 1: 2, 3: 2, 4: 1}.items():  # a kernel sampled by k clients: their mean
        assert sum(i in d.kernels for d in draws) == sampled_by
        assert torch.allclose(V[i], mean_v(i), atol=1e-12)
    for i in (2, 5):  # nobody sampled them: unchanged
        assert torch.equal(V[i], V0[i]) and torch.equal(U[:, i], U0[:, i])
    # u'_0: rows 1 and 4 were computed by all three clients, the other rows by the first two only
    u_first_two = (replies[0][1][:, 0] + replies[1][1][:, 0]) / 2
    assert torch.allclose(U[[0, 2, 3, 5], 0], u_first_two[[0, 2, 3, 5]], atol=1e-12)
    assert torch.allclose(U[[1, 4], 0], (replies[0][1][[1, 4], 0] + replies[1][1][[1, 4], 0] + replies[2][1][:, 0]) / 3)
    # u'_1: sampled by clients 0 and 2; rows other than 1, 4 only by client 0
    assert torch.allclose(U[[0, 2, 3, 5], 1], replies[0][1][[0, 2, 3, 5], 1], atol=1e-12)
    # a client sending back what it got changes nothing
    same = prism.aggregate_kernels(
        factored,
        [(d, U0[d.rows if d.rows is not None else torch.arange(6)][:, d.kernels], V0[d.kernels]) for d in draws],
    )
    assert torch.allclose(same[0] @ same[1], U0 @ V0, atol=1e-12)


def test_refresh_leaves_the_product_unchanged_and_orthogonalises():
    torch.manual_seed(4)
    U, V = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 27, dtype=torch.float64)
    new = prism.refresh(U, V, (8, 3, 3, 3))
    assert torch.allclose(prism.compose(new), prism.fold(U @ V, (8, 3, 3, 3)), atol=1e-11)
    assert torch.allclose(new.U.t() @ new.U, torch.eye(8, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(new.Vh @ new.Vh.t(), torch.eye(8, dtype=torch.float64), atol=1e-12)
    assert torch.all(new.S[:-1] >= new.S[1:])


# ------------------------------------------------------------------------------- the strategy, in process

TOY = (
    "num_clients=6 fraction_train=1.0 dataset.max_train_examples=1200 dataset.max_test_examples=300 "
    "model.width=4 train.batch_size=64 evaluation.batch_size=300 method=prism"
)


def _cfg(extra=""):
    return load_config(f"{TOY} {extra}")


def _echo_handler(shift: float = 0.0):
    """A client that sends back what it received (plus ``shift``), with valid metrics."""

    def handle(msg, context):
        arrays = {k: v + shift for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        return reply(msg, arrays, 10 + int(context.node_config["partition-id"]), [3] * 10)

    return handle


def _round(cfg, handler=None, rnd=1):
    strategy = PriSMStrategy(run_options(cfg), model_spec(cfg))
    handlers = client_handlers()
    if handler is not None:
        handlers[MessageType.TRAIN] = handler
    grid = LocalGrid(6, handlers)
    state = initial_state(cfg.seed, strategy.method.spec)
    messages = list(strategy.configure_train(rnd, ArrayRecord.from_torch_state_dict(state), None, grid))
    replies = grid.send_and_receive(messages)
    new, _ = strategy.aggregate_train(rnd, replies)
    return strategy, state, messages, replies, new.to_torch_state_dict()


def test_each_node_gets_its_own_draw_and_only_ranks_travel():
    cfg = _cfg("levels.ratios=[0.4,0.2] levels.proportions=[0.4,0.6]")
    strategy, state, messages, _, _ = _round(cfg, _echo_handler())
    method = strategy.method
    assert method.layers == ["conv2", "conv3", "conv4"]  # rho = 0: every conv but the stem
    kernels = set()
    for msg in messages:
        node = msg.metadata.dst_node_id
        spec = json.loads(msg.content["config"]["model-spec"])
        index = msg.content["config"]["level-index"]
        draws = method.draws[node]
        for name in method.layers:
            assert spec["prism"][name] == {"rank": prism.keep_count(method.kernels[name], strategy.levels[index])}
            assert len(draws[name].kernels) == spec["prism"][name]["rank"]
        kernels.add(tuple(draws["conv4"].kernels.tolist()))
        got = msg.content["arrays"].to_torch_state_dict()
        model = build_model(spec, spectral_init=False)
        model.load_state_dict(got, strict=True)  # the client can build and load it
        u, v = prism.slice_layer(prism.decompose(state["conv3.weight"]), draws["conv3"])
        assert torch.equal(got["conv3.u.weight"], u) and torch.equal(got["conv3.v.weight"], v)
        assert torch.equal(got["conv1.weight"], state["conv1.weight"])  # unfactorized layers whole
    assert len(kernels) > 1  # clients got different kernels
    # the draws are a function of (seed, round, partition): a second strategy draws the same
    again = PriSMStrategy(run_options(cfg), model_spec(cfg))
    again.method.factored_form(state)
    for node, draws in method.draws.items():
        same = again.method.sample(1, strategy.known.key(node), strategy.wire.sent[node][0])
        assert all(torch.equal(same[n].kernels, draws[n].kernels) for n in method.layers)


def test_echoing_clients_leave_every_product_unchanged_and_refresh_keeps_it():
    for extra in ("", "method.u_subset=true", "method.u_subset=true method.u_subset_rows=random"):
        cfg = _cfg(f"levels.ratios=[0.4,0.2] levels.proportions=[0.4,0.6] {extra}")
        strategy, state, _, _, new = _round(cfg, _echo_handler())
        assert set(new) == set(state) and all(new[k].shape == state[k].shape for k in state)  # full-shape state
        for key in state:
            assert torch.allclose(new[key], state[key], atol=1e-5), (extra, key)
        factored = strategy.method.factored
        for name in strategy.method.layers:  # after the refresh, the factored form is the new weights' SVD
            assert torch.allclose(prism.compose(factored[name]), new[f"{name}.weight"].double(), atol=1e-5)


def test_merge_averages_each_kernel_over_its_samplers_through_the_round():
    cfg = _cfg("levels.ratios=[0.4,0.2] levels.proportions=[0.4,0.6] method.u_subset=true")
    strategy = PriSMStrategy(run_options(cfg), model_spec(cfg))
    handlers = client_handlers()
    shift = {pid: 0.01 * (pid + 1) for pid in range(6)}

    def shifted(msg, context):
        return _echo_handler(shift[int(context.node_config["partition-id"])])(msg, context)

    handlers[MessageType.TRAIN] = shifted
    grid = LocalGrid(6, handlers)
    state = initial_state(cfg.seed, strategy.method.spec)
    before = prism.decompose(state["conv3.weight"])
    messages = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid))
    new, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    new = new.to_torch_state_dict()
    U0, V0 = prism.scaled_factors(before)
    U, V = U0.clone(), V0.clone()
    holders = {}
    for node, draws in strategy.method.draws.items():
        d = draws["conv3"]
        for i in d.kernels.tolist():
            holders.setdefault(i, []).append((node, d))
    for i, who in holders.items():  # by hand: each shift is added to every sent entry
        s = [shift[strategy.nodes[n].partition_id] for n, _ in who]
        V[i] = V0[i] + sum(s) / len(s)
        for j in range(U.shape[0]):
            sj = [shift[strategy.nodes[n].partition_id] for n, d in who if j in d.rows.tolist()]
            U[j, i] = U0[j, i] + sum(sj) / len(sj) if sj else U0[j, i]  # rows nobody computed: û
    expected = prism.fold(U @ V, state["conv3.weight"].shape)
    assert torch.allclose(new["conv3.weight"].double(), expected, atol=1e-5)
    # unfactorized layers: FedAvg by sample count (10 + pid examples)
    n = np.array([10 + pid for pid in range(6)], dtype=np.float64)
    avg_shift = float(np.dot(n / n.sum(), [shift[pid] for pid in range(6)]))
    assert torch.allclose(new["conv1.weight"], state["conv1.weight"] + avg_shift, atol=1e-6)


def test_u_subset_changes_memory_not_the_layer_definition():
    levels = "levels.ratios=[0.8,0.6,0.4,0.2] levels.proportions=[1,1,1,1]"
    off = PriSMStrategy(run_options(_cfg(levels)), model_spec(_cfg())).method
    cfg_on = _cfg(f"{levels} method.u_subset=true")
    on = PriSMStrategy(run_options(cfg_on), model_spec(cfg_on)).method
    state = initial_state(cfg_on.seed, on.spec)
    for index in range(4):  # memory (and Conv_U's parameters) go down
        c_on, c_off = on.level_cost(index), off.level_cost(index)
        assert c_on["activations"] < c_off["activations"] and c_on["params"] < c_off["params"]
    assert on.layers == off.layers and on.shapes == off.shapes and on.kernels == off.kernels
    for method in (on, off):
        method.begin_round(1, state)
    for name in on.layers:  # the server's layer: same factored form, same deployable model
        assert torch.equal(on.factored[name].S, off.factored[name].S)
    for index in range(4):
        spec_on, dep_on = on.deployable(index, state)
        spec_off, dep_off = off.deployable(index, state)
        assert spec_on == spec_off and all(torch.equal(dep_on[k], dep_off[k]) for k in dep_off)
    # the client's layer: the same V side; U restricted to the computed rows J, whose outputs are
    # exactly the full sub-layer's outputs on J; the other output channels are not computed (zero)
    d_on = on.top_k(3)
    _, s_on, _ = on.level_payload(3, state)
    _, s_off, _ = off.level_payload(3, state)
    rows = d_on["conv3"].rows
    assert torch.equal(s_on["conv3.v.weight"], s_off["conv3.v.weight"])
    assert torch.equal(s_on["conv3.u.weight"], s_off["conv3.u.weight"][rows])
    conv = build_model(on.spec).conv3
    full, sub = (PrismConv2d.like(conv, len(d_on["conv3"].kernels), r) for r in (None, rows))
    full.load_state_dict({"v.weight": s_off["conv3.v.weight"], "u.weight": s_off["conv3.u.weight"]})
    sub.load_state_dict({"v.weight": s_on["conv3.v.weight"], "u.weight": s_on["conv3.u.weight"]})
    x = torch.randn(2, conv.in_channels, 7, 7)
    y_full, y_sub = full(x), sub(x)
    assert torch.allclose(y_sub[:, rows], y_full[:, rows], atol=1e-6)
    others = torch.ones(conv.out_channels, dtype=torch.bool)
    others[rows] = False
    assert torch.count_nonzero(y_sub[:, others]) == 0


def test_config_refuses_unknown_sampling_and_negative_kappa():
    with pytest.raises(ConfigError) as err:
        load_config("method=prism method.sampling=topk")
    assert "method.sampling" in str(err.value) and "orthdrop" in str(err.value)
    with pytest.raises(ConfigError, match=r"method\.kappa"):
        load_config("method=prism method.kappa=-1")
    with pytest.raises(ConfigError, match=r"method\.u_subset_rows"):
        load_config("method=prism method.u_subset_rows=last")


def test_inspect_prints_params_macs_and_activation_memory_per_keep_ratio():
    cfg, rows = level_rows(["method=prism", "levels.ratios=[0.8,0.6,0.4,0.2]", "levels.proportions=[1,1,1,1]"])
    assert [r["ratio"] for r in rows] == [0.8, 0.6, 0.4, 0.2]
    for key in ("params", "macs", "activations"):
        values = [r[key] for r in rows]
        assert values == sorted(values, reverse=True) and len(set(values)) == 4, key
    assert all(r["payload_bytes"] == 4 * r["params"] for r in rows)  # parameters sent = the payload
    table = format_table(run_options(cfg), rows)
    assert "activations" in table.splitlines()[1]


@pytest.mark.slow
def test_a_prism_run_learns_and_resumes_like_an_uninterrupted_one(tmp_path):
    cfg = _cfg("rounds=2 checkpoint.every=1 levels.ratios=[0.4,0.2] levels.proportions=[0.4,0.6] train.lr=0.1")
    summary = run(LocalGrid(6, client_handlers()), cfg, tmp_path / "full")
    assert summary["rounds_completed"] == 2 and summary["best_acc/global"] > 0.1  # 10 classes: chance 0.1
    one = load_config(
        f"{TOY} rounds=1 checkpoint.every=1 levels.ratios=[0.4,0.2] levels.proportions=[0.4,0.6] train.lr=0.1"
    )
    run(LocalGrid(6, client_handlers()), one, tmp_path / "cut")
    resumed = resume_config(tmp_path / "cut", "rounds=2")
    run(LocalGrid(6, client_handlers()), resumed, tmp_path / "cut", resume=tmp_path / "cut")
    a, _ = load_checkpoint(tmp_path / "full")
    b, saved = load_checkpoint(tmp_path / "cut")
    assert saved["round"] == 2 and saved["method"]["sampling"] == "prism"
    assert all(torch.equal(a[k], b[k]) for k in a)
