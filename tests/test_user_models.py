"""FedHM on any PyTorch model: the factorization rule, torchvision models, the ViT, the pair check."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch import nn

from fedhm_flwr.config import SUPPORTED_MODELS, ConfigError, load_config, model_spec, run_options
from fedhm_flwr.math.aggregation import average_hybrid
from fedhm_flwr.math.lowrank import factorize_state, recover_state
from fedhm_flwr.models import build_model, count_parameters
from fedhm_flwr.models.rules import FactorizeRule, plan_ranks, select_layers
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run

GREY = "model.target=tests.tv_models:grey model.kwargs.name=mobilenet_v3_small model.kwargs.num_classes=10"
TINY = (
    "num_clients=2 fraction_train=1.0 dataset.max_train_examples=40 dataset.max_test_examples=20 rounds=1 "
    "levels.ratios=[1,0.5] evaluation.levels=false train.batch_size=32 evaluation.batch_size=20 "
    "tracking.tensorboard=false"
)


def tv_spec(name: str, **extra) -> dict:
    return {
        "arch": "custom",
        "target": f"torchvision.models:{name}",
        "kwargs": {"num_classes": 5},
        "num_classes": 5,
        "in_channels": 3,
        "image_size": 32,
        **extra,
    }


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.Conv2d(8, 8, 1),  # 3x3, 1x1
            nn.Conv2d(8, 8, 3, padding=1, groups=8),  # depthwise
            nn.Conv2d(8, 8, 3, padding=2, dilation=2),
        )  # dilated
        self.attn = nn.MultiheadAttention(8, 2)  # out_proj is read as a raw weight: never selected
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.body(self.stem(x)).mean((2, 3))
        return self.head(self.hidden(x))


def test_rule_selects_what_it_says():
    toy = Toy()
    assert select_layers(toy) == ["stem", "body.0", "body.1", "hidden"]  # 1x1 too; no head, depthwise, dilated, MHA
    assert select_layers(toy, FactorizeRule(pointwise=False)) == ["stem", "body.0", "hidden"]
    assert select_layers(toy, FactorizeRule(types=("Linear",))) == ["hidden"]
    assert select_layers(toy, FactorizeRule(include=("body.*",))) == ["body.0", "body.1"]
    assert select_layers(toy, FactorizeRule(exclude=("stem",))) == ["body.0", "body.1", "hidden"]
    assert select_layers(toy, FactorizeRule(head=True)) == ["stem", "body.0", "body.1", "hidden", "head"]
    assert list(plan_ranks(toy, 0.5)) == ["body.0", "body.1", "hidden"]  # keep_first defaults to 1 (the stem)
    toy.factorize_rule = FactorizeRule(keep_first=2)
    assert list(plan_ranks(toy, 0.5)) == ["body.1", "hidden"]
    assert list(plan_ranks(toy, 0.5, rho=0)) == ["stem", "body.0", "body.1", "hidden"]  # method.rho wins


def test_shortcuts_stay_full_by_the_default_rule():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 16, 3, padding=1)
            self.downsample = nn.Sequential(nn.Conv2d(8, 16, 1))
            self.shortcut = nn.Conv2d(8, 16, 1)

    assert select_layers(Block()) == ["conv"]
    assert select_layers(Block(), FactorizeRule(exclude=())) == ["conv", "downsample.0", "shortcut"]


def test_a_layer_whose_factors_would_be_larger_stays_full():
    """1x1 convs take the linear rank rule; any layer whose rank-r factors would hold more
    parameters than the layer itself is kept full at that level (counted from the shapes)."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.Conv2d(8, 1024, 1),
        nn.Conv2d(1024, 192, 1),
        nn.Conv2d(48, 48, 1),
        nn.Linear(64, 64),
        nn.Linear(10, 2),
    )
    model.factorize_rule = FactorizeRule(keep_first=1, head=True)
    plan = plan_ranks(model, 0.5)
    # 8->1024: r = round(0.5 * 8) = 4, 4 * 1032 <= 8192; 1024->192: r = 96, 96 * 1216 < 196608;
    # 48->48 and 64x64 at r = n/2: factors equal the layer (kept factorized); head 10->2: r = 1, 12 <= 20
    assert plan == {"1": 4, "2": 96, "3": 24, "4": 32, "5": 1}
    plan = plan_ranks(model, 0.75)  # 48x48 at r = 36: 3456 > 2304; 64x64 at r = 48: 6144 > 4096; 10->2 at r=2: 24 > 20
    assert plan == {"1": 6, "2": 144}


def test_built_in_models_keep_their_plans_through_the_rule():
    cnn = build_model({"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28})
    assert select_layers(cnn) == ["conv2", "conv3", "conv4"] and list(plan_ranks(cnn, 0.5)) == ["conv3", "conv4"]
    spec = {
        "arch": "cnn",
        "num_classes": 10,
        "in_channels": 1,
        "image_size": 28,
        "factorize": {"keep_first": 0, "exclude": ["conv1", "conv4"]},
    }
    assert list(plan_ranks(build_model(spec), 0.5)) == ["conv2", "conv3"]  # model.factorize on a built-in


def test_mobilenet_default_rule_factorizes_pointwise_and_leaves_head_and_depthwise_full():
    with torch.device("meta"):
        model = build_model(tv_spec("mobilenet_v3_small"))
    chosen = select_layers(model)
    assert chosen[0] == "features.0.0" and chosen[-1] == "classifier.0"
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            assert (name in chosen) == (m.groups == 1)  # every conv but the depthwise ones, 1x1 included
    assert model.classifier_name == "classifier.3" and "classifier.3" not in chosen  # the logits layer: left full


@pytest.mark.parametrize(
    "name,rule",
    [
        # ResNet-18: the first two stages (a float64 SVD of layer3/4's 1536x1536 matrices takes minutes on
        # this shared CPU); they hold every kind of block conv, strided ones included
        ("resnet18", {"include": ["layer1.*", "layer2.*"], "keep_first": 0}),
        ("mobilenet_v3_small", {"keep_first": 0}),  # the stem and classifier.0
    ],
)
def test_torchvision_models_factorize_exactly_at_full_rank(name, rule):
    torch.manual_seed(0)
    spec = tv_spec(name, factorize=rule)
    model = build_model(spec).eval()
    names = select_layers(model)
    assert names
    ranks = {}
    for layer in names:  # full rank of the layer matrix, from its shape
        w = model.get_submodule(layer).weight
        ranks[layer] = w.shape[2] * min(w.shape[:2]) if w.ndim == 4 else min(w.shape)
    full = model.state_dict()
    hybrid_state = factorize_state(full, ranks)
    hybrid = build_model({**spec, "ranks": ranks}, spectral_init=False).eval()
    hybrid.load_state_dict(hybrid_state)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(hybrid(x), model(x), atol=1e-4, rtol=1e-4)
    recovered = recover_state(hybrid_state, ranks)
    assert all(torch.allclose(recovered[k].float(), full[k].float(), atol=1e-5) for k in full)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_reduced_levels_have_the_planned_counts(name):
    with torch.device("meta"):
        model = build_model(tv_spec(name))
        total = sum(p.numel() for p in model.parameters())
        for gamma in (0.5, 0.25, 0.125):
            plan = plan_ranks(model, gamma)
            expected = total
            for i, layer in enumerate(select_layers(model)):
                shape = model.get_submodule(layer).weight.shape
                if i == 0:  # the first selected layer stays full (default keep_first)
                    assert layer not in plan
                    continue
                if len(shape) == 4:
                    n, m, k, _ = shape
                    base = n if k > 1 else min(n, m)  # a 1x1 conv takes the linear rule
                    rank = min(k * min(n, m), max(1, math.floor(gamma * base + 0.5)))
                    rows, cols = n * k, m * k
                else:
                    rank = max(1, math.floor(gamma * min(shape) + 0.5))
                    rows, cols = shape
                if rank * (rows + cols) > rows * cols:  # larger factors: the layer stays full
                    assert layer not in plan
                    continue
                expected += rank * (rows + cols) - rows * cols
                assert plan[layer] == rank
            level = build_model({**tv_spec(name), "ranks": plan}, spectral_init=False)
            assert count_parameters(level) == expected < total


def test_resnet18_from_torchvision_has_the_papers_layer_plan():
    with torch.device("meta"):
        model = build_model(tv_spec("resnet18"))
    chosen = select_layers(model)  # stem conv1 (7x7), the 16 block convs; no 1x1 downsample, no fc
    assert chosen[0] == "conv1" and len(chosen) == 17 and not any("downsample" in c or c == "fc" for c in chosen)


def test_running_statistics_travel_and_are_averaged_as_buffers():
    prev = {
        "bn.running_mean": torch.zeros(3),
        "bn.running_var": torch.ones(3),
        "bn.num_batches_tracked": torch.tensor(0),
    }
    a = {
        "bn.running_mean": torch.tensor([1.0, 2, 3]),
        "bn.running_var": torch.tensor([2.0, 2, 2]),
        "bn.num_batches_tracked": torch.tensor(4),
    }
    b = {
        "bn.running_mean": torch.tensor([3.0, 2, 1]),
        "bn.running_var": torch.tensor([4.0, 4, 4]),
        "bn.num_batches_tracked": torch.tensor(8),
    }
    out = average_hybrid(prev, [a, b], [{}, {}], [0.25, 0.75])
    assert torch.allclose(out["bn.running_mean"], torch.tensor([2.5, 2.0, 1.5]))
    assert torch.allclose(out["bn.running_var"], torch.tensor([3.5, 3.5, 3.5]))
    assert int(out["bn.num_batches_tracked"]) == 7


def test_static_bn_replaces_running_statistics_by_batch_statistics():
    spec = tv_spec("mobilenet_v3_small", static_bn=True)
    spec["kwargs"]["dropout"] = 0.0
    torch.manual_seed(0)
    model = build_model(spec)
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in model.state_dict())
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        train_out = model.train()(x)
        assert torch.allclose(model.eval()(x), train_out, atol=1e-5)  # evaluation uses the batch's statistics


def test_one_fedhm_round_on_a_torchvision_model(tmp_path):
    from fedhm_flwr.reporting.results import load_checkpoint

    cfg = load_config(f"{TINY} {GREY} model.static_bn=false")  # running statistics kept, averaged as buffers
    run(LocalGrid(2, client_handlers()), cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 2 and rows[-1]["failures"] == 0
    state, _ = load_checkpoint(tmp_path / "run")
    assert set(state) == set(build_model(model_spec(cfg), spectral_init=False).state_dict())
    # the BN running statistics (initially 0) came back from the clients' training and were averaged
    assert state["features.0.1.running_mean"].abs().sum() > 0


def test_vit_is_factorized_in_blocks_and_exact_at_full_rank():
    spec = model_spec(load_config("method=fedhm model=vit model.backbone=random model.width=16 model.depth=2"))
    model = build_model(spec).eval()
    names = select_layers(model)
    assert names == [
        f"blocks.{b}.{p}"
        for b in range(2)
        for p in ("attn.query", "attn.key", "attn.value", "attn.out", "mlp.0", "mlp.2")
    ]
    assert set(plan_ranks(model, 0.25)) == set(names[6:])  # the first block stays full (default rho)
    assert all(p.requires_grad for p in model.parameters())  # FedHM trains the whole ViT
    ranks = {n: min(model.get_submodule(n).weight.shape) for n in names}
    hybrid = build_model({**spec, "ranks": ranks}, spectral_init=False).eval()
    hybrid.load_state_dict(factorize_state(model.state_dict(), ranks))
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(hybrid(x), model(x), atol=1e-5)


def test_inspect_prints_the_plan_of_a_torchvision_model(capsys):
    from fedhm_flwr.ops.tools.cost_table import main

    assert main(["model.target=torchvision.models:resnet18", "model.kwargs.num_classes=10", "dataset=cifar10"]) == 0
    out = capsys.readouterr().out
    assert "torchvision.models:resnet18" in out and "| g4 | 0.125 | 1,176,138 |" in out
    # layer4.1.conv2: 512x512x3x3, rank round(512 / 8) = 64, 64 * (1536 + 1536) parameters
    assert (
        "| layer4.1.conv2 | Conv2d | 512x512x3x3 | 2,359,296 | full | r=256 (786,432) | r=128 (393,216) "
        "| r=64 (196,608) |" in out
    )
    assert "| conv1 | Conv2d | 64x3x7x7 | 9,408 | full | full | full | full |" in out


# ------------------------------------------------------------------------------------ pairs

_MODELS = {
    "cnn": "model=cnn model.width=2",
    "resnet18": "model=resnet18 model.width=2",
    "resnet34": "model=resnet34 model.width=2",
    "vit": "model=vit dataset=fashion_mnist model.backbone=random model.width=16 model.depth=2",
    "custom": f"dataset=fashion_mnist {GREY}",
    "minilm": "model=minilm dataset=sentiment model.backbone=random model.width=32 model.depth=1 model.heads=2",
}
_METHODS = {
    "fedhm": "method=fedhm",
    "fedavg": "method=fedavg",
    "fedavg_smallest": "method=fedavg_smallest",
    "fedavg/heterofl": "method=fedavg_smallest method.family=heterofl",
    "heterofl": "method=heterofl",
    "fedrolex": "method=fedrolex",
    "prism": "method=prism",
    "fedlora": "method=fedlora method.max_rank=2",
    "heterotune": "method=heterotune method.bottleneck=4",
}


def _key(method: str) -> str:
    return "fedavg" if method == "fedavg_smallest" else method


ACCEPTED = [(m, a) for m in _METHODS for a in _MODELS if a in SUPPORTED_MODELS[_key(m)]]
# the MiniLM pairs run in tests/test_transformer_track.py, FedHM on a torchvision model above
ROUNDS = [(m, a) for m, a in ACCEPTED if a != "minilm" and (m, a) != ("fedhm", "custom")]
REFUSED = [(m, a) for m in _METHODS for a in _MODELS if a not in SUPPORTED_MODELS[_key(m)]]


@pytest.mark.parametrize("method,arch", ROUNDS)
def test_every_accepted_pair_runs_one_round(method, arch, tmp_path):
    cfg = load_config(f"{TINY} {_METHODS[method]} {_MODELS[arch]}")
    run(LocalGrid(2, client_handlers()), cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 2 and rows[-1]["failures"] == 0, rows[-1].get("failure_reasons")


def test_the_config_check_knows_every_architecture_without_importing_torch():
    from fedhm_flwr.config import ARCH_NAMES
    from fedhm_flwr.models import ARCHS

    assert set(ARCH_NAMES) == set(ARCHS) == {arch for archs in SUPPORTED_MODELS.values() for arch in archs}
    code = (
        "import sys; from fedhm_flwr.config import ConfigError, load_config\n"
        "try:\n    load_config('method=heterofl model=vit')\nexcept ConfigError as err:\n"
        "    assert err.field == 'model.arch', err\n"
        "assert 'torch' not in sys.modules, 'the pair check imported torch'\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_unsupported_pairs_are_refused_quickly_listing_the_supported_ones():
    assert len(REFUSED) >= 20
    start = time.perf_counter()
    for method, arch in REFUSED:
        with pytest.raises(ConfigError, match=r"model\.(arch|target).*Supported pairs: fedhm: \["):
            load_config(f"{_METHODS[method]} {_MODELS[arch]}")
    assert (time.perf_counter() - start) / len(REFUSED) < 5


def test_bad_targets_and_rules_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.target='torchvision\.models:nope'"):
        load_config("model.target=torchvision.models:nope")
    with pytest.raises(ConfigError, match=r"model\.target='no_such_package\.x:f'"):
        load_config("model.target=no_such_package.x:f")
    with pytest.raises(ConfigError, match=r"model\.target=.*HeteroFL slices channel widths"):
        load_config(f"method=heterofl {GREY}")
    with pytest.raises(ConfigError, match=r"model\.target=None"):
        load_config("model=custom")
    with pytest.raises(ConfigError, match=r"model\.factorize\.types=\['Conv1d'\]; allowed: null or a non-empty list"):
        load_config("model.factorize.types=[Conv1d]")
    with pytest.raises(ConfigError, match=r"model\.factorize\.keep_first=-1"):
        load_config("model.factorize.keep_first=-1")
    # the model is run on the meta device: its outputs must be the dataset's classes, its input the dataset's images
    with pytest.raises(
        ConfigError,
        match=r"model\.kwargs\.num_classes=100; allowed: 10: dataset\.name=fashion_mnist "
        r"has 10 classes and the model gives 100 outputs",
    ):
        load_config(GREY.replace("num_classes=10", "num_classes=100"))
    with pytest.raises(
        ConfigError,
        match=r"model\.target='torchvision\.models:resnet18'; allowed: a factory whose model "
        r"takes a batch of shape \(N, 1, 28, 28\)",
    ):
        load_config("model.target=torchvision.models:resnet18 model.kwargs.num_classes=10")


def test_inspect_counts_the_vit_levels_from_shapes_as_the_allocating_path_does():
    from fedhm_flwr.ops.tools.cost_table import _rows, level_rows, plan_rows
    from fedhm_flwr.server.registry import STRATEGIES

    overrides = ["method=fedhm", "model=vit", "model.backbone=random", "model.width=16", "model.depth=2"]
    cfg, rows = level_rows(overrides)
    spec = model_spec(cfg)
    opts = run_options(cfg)
    assert rows == _rows(opts, spec, STRATEGIES["fedhm"](opts, spec).method)
    assert rows[0]["params"] == count_parameters(build_model(spec))
    plan = plan_rows(opts, spec)
    saved = [sum(p["params"] - lp for p in plan for lp in [p["level_params"][i]]) for i in range(len(rows))]
    assert [rows[0]["params"] - r["params"] for r in rows] == saved  # the plan explains every level's count
    assert all(p["ranks"][-1] is None for p in plan[:6]) and all(p["ranks"][-1] == 2 for p in plan[6:])


def test_a_rule_factorizing_the_head_ends_its_per_class_averaging():
    with torch.device("meta"):
        model = build_model(tv_spec("mobilenet_v3_small", factorize={"head": True}))
    assert select_layers(model)[-1] == "classifier.3" and model.classifier_name == ""
    from fedhm_flwr.server.methods.fedhm import classifier_keys

    assert classifier_keys(model) == []
