"""HeteroFL, FedRolex and FedAvg on the shared round; FedHM's ablation switches (docs/METHODS.md#heterofl,
#fedrolex, #fedavg, #fedhm-official-code)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from reply_helpers import reply
from torch.utils.data import TensorDataset

from fedhm_flwr.config import ConfigError, model_spec, run_options
from fedhm_flwr.math.lowrank import recover_state
from fedhm_flwr.math.train import TrainOptions, parameter_groups, train_local
from fedhm_flwr.models import build_model
from fedhm_flwr.models.rules import plan_ranks
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state, run
from fedhm_flwr.server.registry import STRATEGIES, FedAvgStrategy, FedRolexStrategy, HeteroFLStrategy
from fedhm_flwr.server.strategy import Reply


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _strategy(cfg):
    return STRATEGIES[cfg.method.name](run_options(cfg), model_spec(cfg))


def _configure(strategy, grid, state, rnd=1):
    return list(strategy.configure_train(rnd, ArrayRecord.from_torch_state_dict(state), None, grid))


def _replies(states, levels, counts, holds, level_index=None):
    return [
        Reply(
            node_id=i,
            level_index=level_index[i] if level_index else 0,
            level=levels[i],
            state=s,
            num_examples=counts[i],
            class_counts=np.asarray(holds[i], dtype=np.int64),
            metrics={},
        )
        for i, s in enumerate(states)
    ]


def _noisy(state, scale=0.1):
    return {k: v + scale * torch.randn_like(v) for k, v in state.items()}


# ---------------------------------------------------------------- registry and config


def test_methods_registered_with_their_configs(toy_cfg):
    for name, cls in (("heterofl", HeteroFLStrategy), ("fedrolex", FedRolexStrategy), ("fedavg", FedAvgStrategy)):
        cfg = toy_cfg(f"method={name}")
        assert cfg.method.name == name and STRATEGIES[name] is cls
    cfg = toy_cfg("method=heterofl")
    assert cfg.method.scaler is True and cfg.method.grad_clip == 1.0 and cfg.train.masked_ce is True
    cfg = toy_cfg("method=fedavg")
    assert (cfg.method.variant, cfg.method.family) == ("full", "fedhm")
    # both rate sets are expressible
    assert list(
        toy_cfg("method=heterofl levels.ratios=[1,0.5,0.25,0.125,0.0625] levels.proportions=[1,1,1,1,1]").levels.ratios
    ) == [1, 0.5, 0.25, 0.125, 0.0625]
    assert list(toy_cfg("method=fedrolex levels.ratios=[1,0.64,0.5,0.35]").levels.ratios) == [1, 0.64, 0.5, 0.35]


@pytest.mark.parametrize(
    "override,field",
    [
        ("method=fedavg method.variant=half", "method.variant"),
        ("method=fedavg method.family=prism", "method.family"),
        ("method=heterofl method.grad_clip=-1", "method.grad_clip"),
        ("method=fedrolex method.scaler=maybe", "method.scaler"),
    ],
)
def test_bad_values_refused_naming_the_field(toy_cfg, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        toy_cfg(override)


# ---------------------------------------------------------------- HeteroFL / FedRolex payloads


def test_heterofl_nodes_receive_their_levels_first_channels(toy_cfg):
    cfg = toy_cfg("method=heterofl")
    strategy = _strategy(cfg)
    state = initial_state(cfg.seed, strategy.method.spec)
    seen = set()
    for msg in _configure(strategy, LocalGrid(6, client_handlers()), state):
        config = msg.content["config"]
        spec, train = json.loads(config["model-spec"]), json.loads(config["train"])
        rate = float(config["level"])
        seen.add(rate)
        assert train["grad_clip"] == 1.0 and train["masked_ce"] is True
        assert spec.get("width_rate", 1.0) == rate and spec.get("scaler", False) == (rate < 1)
        got = msg.content["arrays"].to_torch_state_dict()
        model = build_model(spec)
        model.load_state_dict(got, strict=True)  # same keys and shapes as the sub-model
        k1, k2 = model.conv1.out_channels, model.conv2.out_channels
        assert k1 == math.ceil(rate * 4) and k2 == math.ceil(rate * 8)
        assert torch.equal(got["conv2.weight"], state["conv2.weight"][:k2, :k1])
        assert torch.equal(got["fc.weight"], state["fc.weight"][:, : model.fc.in_features])
    assert seen == {1.0, 0.5, 0.25, 0.125}


def test_fedrolex_payload_follows_the_rounds_window(toy_cfg):
    cfg = toy_cfg("method=fedrolex levels.ratios=[0.5] levels.proportions=[1]")
    strategy = _strategy(cfg)
    state = initial_state(cfg.seed, strategy.method.spec)
    grid = LocalGrid(6, client_handlers())
    for rnd in (1, 3, 8):
        msg = _configure(strategy, grid, state, rnd)[0]
        got = msg.content["arrays"].to_torch_state_dict()
        j = rnd - 1
        rows = sorted((i + j) % 8 for i in range(4))  # conv2: K = 8, 4 kept
        cols = sorted((i + j) % 4 for i in range(2))  # its input conv1: K = 4, 2 kept
        assert torch.equal(got["conv2.weight"], state["conv2.weight"][rows][:, cols])
    heterofl = _strategy(toy_cfg("method=heterofl levels.ratios=[0.5] levels.proportions=[1]"))
    first = _configure(strategy, grid, state, 1)[0].content["arrays"].to_torch_state_dict()
    static = _configure(heterofl, grid, state, 1)[0].content["arrays"].to_torch_state_dict()
    assert all(torch.equal(first[k], static[k]) for k in first)  # round 1 = HeteroFL's slice


def _plus_one_handler(counts_by_pid):
    """A client that adds 1 to every received tensor and holds the given classes."""

    def handle(msg, context):
        pid = int(context.node_config["partition-id"])
        out = {k: v + 1 for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        return reply(msg, out, 10 + pid, counts_by_pid[pid])

    return handle


def test_fedrolex_round_updates_exactly_the_rounds_window(toy_cfg):
    cfg = toy_cfg("method=fedrolex levels.ratios=[0.5,0.25] levels.proportions=[1,1]")
    strategy = _strategy(cfg)
    state = initial_state(cfg.seed, strategy.method.spec)
    handlers = client_handlers()
    handlers["train"] = _plus_one_handler({p: [5] * 10 for p in range(6)})
    grid = LocalGrid(6, handlers)
    rnd = 7  # j = 6
    replies = grid.send_and_receive(_configure(strategy, grid, state, rnd))
    new = strategy.aggregate_train(rnd, replies)[0].to_torch_state_dict()
    held = sorted((i + 6) % 4 for i in range(2))  # conv1 rows of the rate-0.5 window (K = 4): [2, 3]
    assert torch.allclose(new["conv1.weight"][held], state["conv1.weight"][held] + 1)
    assert torch.equal(new["conv1.weight"][[0, 1]], state["conv1.weight"][[0, 1]])
    cols = sorted((i + 6) % 32 for i in range(16))  # classifier input: conv4's window (K = 32)
    rest = sorted(set(range(32)) - set(cols))
    assert torch.allclose(new["fc.weight"][:, cols], state["fc.weight"][:, cols] + 1)
    assert torch.equal(new["fc.weight"][:, rest], state["fc.weight"][:, rest])
    assert torch.allclose(new["fc.bias"], state["fc.bias"] + 1)


# ---------------------------------------------------------------- aggregation equivalences


@pytest.mark.parametrize("by_samples", [False, True])
def test_full_rate_heterofl_round_equals_fedavg_on_identical_replies(toy_cfg, by_samples):
    heterofl = _strategy(
        toy_cfg(
            f"method=heterofl levels.ratios=[1] levels.proportions=[1] "
            f"method.weight_by_samples={str(by_samples).lower()}"
        )
    )
    fedavg = _strategy(toy_cfg("method=fedavg"))
    assert fedavg.levels == [1.0]
    state = initial_state(toy_cfg().seed, heterofl.method.spec)
    states = [_noisy(state) for _ in range(3)]
    counts = [20, 20, 20] if not by_samples else [10, 30, 60]
    holds = [[3, 0, 1, 0, 5, 5, 5, 5, 5, 0], [0, 2, 2, 2, 2, 2, 2, 2, 2, 0], [1] * 9 + [0]]
    replies = _replies(states, [1.0] * 3, counts, holds)
    a = heterofl.method.merge(1, state, replies)
    b = fedavg.method.merge(1, state, replies)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert torch.equal(a["fc.weight"][9], state["fc.weight"][9])  # a class nobody held


def test_fedavg_variants_train_the_right_model(toy_cfg):
    full = _strategy(toy_cfg("method=fedavg"))
    state = initial_state(toy_cfg().seed, full.method.spec)
    spec, payload, _ = full.method.level_payload(0, state)
    assert spec == full.method.spec and all(torch.equal(payload[k], state[k]) for k in state)

    small = _strategy(toy_cfg("method=fedavg method.variant=smallest"))  # family fedhm: gamma = 0.125
    assert small.levels == [0.125]
    small.method.begin_round(1, state)
    spec, payload, options = small.method.level_payload(0, state)
    assert spec["ranks"] == plan_ranks(build_model(full.method.spec), 0.125) and options["frobenius_decay"] is True
    # aggregation: FedAvg by samples of the recovered models
    states = [_noisy(payload) for _ in range(2)]
    replies = _replies(states, [0.125] * 2, [10, 30], [[1] * 10] * 2)
    new = small.method.merge(1, state, replies)
    rec = [recover_state(s, spec["ranks"]) for s in states]
    for k in new:
        assert torch.allclose(new[k], 0.25 * rec[0][k] + 0.75 * rec[1][k], atol=1e-5), k

    width = _strategy(toy_cfg("method=fedavg method.variant=smallest method.family=heterofl"))
    spec, payload, options = width.method.level_payload(0, state)
    assert spec["width_rate"] == 0.125 and spec["scaler"] is True and options["grad_clip"] == 1.0
    assert payload["conv2.weight"].shape == (1, 1, 3, 3)  # ceil(8/8), ceil(4/8)


# ---------------------------------------------------------------- FedHM ablation switches


def test_rho_zero_factorizes_everything_factorizable(toy_cfg):
    default, no_hybrid = _strategy(toy_cfg()), _strategy(toy_cfg("method.rho=0"))
    model = build_model(default.method.spec)
    index = default.levels.index(0.5)
    assert set(no_hybrid.method.ranks[index]) == set(model.factorizable_layers()) == {"conv2", "conv3", "conv4"}
    assert set(default.method.ranks[index]) == {"conv3", "conv4"}  # conv2 kept full by default (rho = 1)
    state = initial_state(toy_cfg().seed, default.method.spec)
    for s in (default, no_hybrid):
        s.method.begin_round(1, state)
    assert "conv2.weight" in default.method.level_payload(index, state)[1]
    sent = no_hybrid.method.level_payload(index, state)[1]
    assert "conv2.weight" not in sent and "conv2.a.weight" in sent and "conv2.b.weight" in sent
    with torch.device("meta"):  # ResNet-18: all 16 block convs, never the stem, shortcuts or fc
        r18 = build_model({"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32})
    assert list(plan_ranks(r18, 0.5, 0)) == r18.factorizable_layers() and len(r18.factorizable_layers()) == 16


def test_frobenius_decay_off_means_weight_decay_on_everything(toy_cfg):
    on, off = _strategy(toy_cfg()), _strategy(toy_cfg("method.frobenius_decay=false"))
    state = initial_state(toy_cfg().seed, on.method.spec)
    index = on.levels.index(0.5)
    for s in (on, off):
        s.method.begin_round(1, state)
    assert on.method.level_payload(index, state)[2] == {"frobenius_decay": True}
    assert off.method.level_payload(index, state)[2] == {"frobenius_decay": False}  # what is sent
    spec = on.method.level_spec(index)
    model = build_model(spec, spectral_init=False)
    factor_ids = {id(p) for n, p in model.named_parameters() if ".a." in n or ".b." in n}
    groups_on = parameter_groups(model, 0.1, True)
    groups_off = parameter_groups(model, 0.1, False)
    assert {id(p) for p in groups_on[1]["params"]} == factor_ids and groups_on[1]["weight_decay"] == 0.0
    assert len(groups_off) == 1 and {id(p) for p in groups_off[0]["params"]} >= factor_ids
    # what is trained: the factors end up different
    data = TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    trained = []
    for frob in (True, False):
        m = build_model(spec, spectral_init=False)
        m.load_state_dict(on.method.level_payload(index, state)[1])
        train_local(
            m,
            data,
            TrainOptions(lr=0.1, batch_size=8, weight_decay=0.5, frobenius_decay=frob, masked_ce=False),
            torch.device("cpu"),
            seed=0,
        )
        trained.append(m.state_dict())
    assert not torch.allclose(trained[0]["conv3.a.weight"], trained[1]["conv3.a.weight"])
    assert torch.allclose(trained[0]["conv1.weight"], trained[1]["conv1.weight"])  # full-rank: decayed either way


def _two_level_replies(strategy, state, counts):
    strategy.method.begin_round(1, state)
    torch.manual_seed(3)
    states = [_noisy(strategy.method.level_payload(i, state)[1]) for i in (0, 1)]
    return states, _replies(states, [strategy.levels[0], strategy.levels[1]], counts, [[1] * 10] * 2, [0, 1])


def test_tau_inf_parses_and_gives_uniform_weights(toy_cfg):
    assert run_options(toy_cfg("method.tau=.inf")).method.tau == math.inf  # YAML's spelling, from the command line
    assert run_options(toy_cfg("method.tau=inf")).method.tau == math.inf
    levels = "levels.ratios=[1,0.5] levels.proportions=[1,1]"
    soft, uniform = _strategy(toy_cfg(levels)), _strategy(toy_cfg(f"{levels} method.tau=.inf"))
    state = initial_state(toy_cfg().seed, soft.method.spec)
    states, replies = _two_level_replies(soft, state, [10, 10])
    uniform.method.begin_round(1, state)
    rec = [recover_state(states[0], soft.method.ranks[0]), recover_state(states[1], soft.method.ranks[1])]
    new_u, new_s = uniform.method.merge(1, state, replies), soft.method.merge(1, state, replies)
    w0 = math.e / (math.e + math.exp(0.5))  # softmax(gamma / 1) over levels 1 and 0.5
    for k in ("conv3.weight", "fc.weight", "bn2.bias"):
        assert torch.allclose(new_u[k], 0.5 * rec[0][k] + 0.5 * rec[1][k], atol=1e-5)
        assert torch.allclose(new_s[k], w0 * rec[0][k] + (1 - w0) * rec[1][k], atol=1e-5)
        assert not torch.allclose(new_u[k], new_s[k], atol=1e-5)


def test_weight_by_samples_multiplies_by_the_sample_counts(toy_cfg):
    base = "levels.ratios=[1,0.5] levels.proportions=[1,1] method.tau=inf"
    plain, by_n = _strategy(toy_cfg(base)), _strategy(toy_cfg(f"{base} method.weight_by_samples=true"))
    state = initial_state(toy_cfg().seed, plain.method.spec)
    states, replies = _two_level_replies(plain, state, [10, 30])
    by_n.method.begin_round(1, state)
    rec = [recover_state(states[0], plain.method.ranks[0]), recover_state(states[1], plain.method.ranks[1])]
    new_p, new_n = plain.method.merge(1, state, replies), by_n.method.merge(1, state, replies)
    for k in ("conv3.weight", "fc.weight"):
        assert torch.allclose(new_p[k], 0.5 * rec[0][k] + 0.5 * rec[1][k], atol=1e-5)
        assert torch.allclose(new_n[k], 0.25 * rec[0][k] + 0.75 * rec[1][k], atol=1e-5)


# ---------------------------------------------------------------- whole in-process runs


@pytest.mark.parametrize(
    "overrides,levels",
    [
        ("method=heterofl", [1.0, 0.5, 0.25, 0.125]),
        ("method=fedrolex levels.ratios=[1,0.64,0.5,0.35]", [1.0, 0.64, 0.5, 0.35]),
        ("method=fedavg", [1.0]),
        ("method=fedavg method.variant=smallest", [0.125]),
        ("method=fedavg method.variant=smallest method.family=heterofl", [0.125]),
    ],
)
def test_two_round_run_writes_per_level_accuracies(toy_cfg, tmp_path, overrides, levels):
    cfg = toy_cfg(f"rounds=2 num_clients=4 dataset.max_train_examples=600 {overrides}")
    summary = run(LocalGrid(4, client_handlers()), cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert summary["method"] == cfg.method.name and summary["levels"] == levels
    for lvl in levels:
        assert 0.0 <= rows[-1][f"acc/level_{lvl:g}"] <= 1.0
        assert summary[f"final_acc/level_{lvl:g}"] == rows[-1][f"acc/level_{lvl:g}"]
        assert summary["level_costs"][f"{lvl:g}"]["params"] > 0
    assert 0.0 <= rows[-1]["acc/global"] <= 1.0
    assert all(r["replies"] == 4 and r["rejected"] == 0 and r["failures"] == 0 for r in rows)
    assert (tmp_path / "summary.json").is_file()
