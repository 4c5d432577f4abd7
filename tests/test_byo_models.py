"""Bring-your-own models: what the config check accepts works on the clients.

For each model of a list of torchvision classifiers and a user's GroupNorm CNN: ``fedhm inspect``'s
rows and plan, every level smaller than the full model, the classifier head (found by what it does)
left full, and one training step per level on a model built and loaded exactly as a client does
(``fedhm_flwr.client.handlers.load_model`` of plain tensors: no ``_metadata``).
"""

from __future__ import annotations

import copy
import pickle
import time

import pytest
import torch
import torch.nn.functional as F

from fedhm_flwr.client.handlers import load_model
from fedhm_flwr.config import ConfigError, load_config, model_spec, run_options
from fedhm_flwr.models import build_model, count_parameters, shape_device
from fedhm_flwr.ops.tools.cost_table import level_rows, main, plan_rows
from fedhm_flwr.server.methods.common import classifier_keys
from fedhm_flwr.server.registry import STRATEGIES

LEVELS = "levels.ratios=[1,0.5,0.125]"
#: (torchvision.models factory, the head it must find): small ones, a few seconds each on one CPU thread
TORCHVISION = [
    ("squeezenet1_1", "classifier.1"),  # a 1x1 convolution produces the logits
    ("mnasnet0_5", "classifier.1"),  # loading needs the state's _metadata version
    ("shufflenet_v2_x0_5", "fc"),
    ("mobilenet_v2", "classifier.1"),
    ("resnet18", "fc"),
]
GN_CNN = "model.target=tests.tv_models:gn_cnn model.kwargs.width=4 dataset=fashion_mnist"


@pytest.fixture
def one_thread():
    """One torch thread: this shared CPU's two cores spin on a thread pool for batch-2 convolutions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _every_level_trains_as_a_client(overrides: list[str], head: str) -> list[int]:
    """Inspect, then one SGD step per level on the model a client of that level builds and loads;
    returns the levels' parameter counts."""
    cfg, rows = level_rows(overrides)
    params = [r["params"] for r in rows]
    assert all(p < params[0] for p in params[1:]), params  # every level smaller than the full model
    plan = plan_rows(run_options(cfg), model_spec(cfg))
    assert plan and head not in {row["layer"] for row in plan}  # the head stays full at every level
    spec = model_spec(cfg)
    with shape_device(spec):  # what the server sends each level, from shapes (as `fedhm inspect`)
        strategy = STRATEGIES[cfg.method.name](run_options(cfg), spec)
        state = build_model(spec, spectral_init=False).state_dict()
        strategy.method.begin_round(1, state)
        payloads = [strategy.method.level_payload(i, state)[:2] for i in range(len(strategy.levels))]
        assert build_model(spec, spectral_init=False).classifier_name == head
    torch.manual_seed(0)
    x = torch.randn(2, int(spec["in_channels"]), int(spec["image_size"]), int(spec["image_size"]))
    y = torch.tensor([0, 1])
    for (level_spec, payload), expected in zip(payloads, params):
        # the arrays as they arrive: plain tensors with the payload's keys and shapes, no _metadata
        sent = {k: v.clone() for k, v in build_model(level_spec, spectral_init=False).state_dict().items()}
        assert {k: tuple(v.shape) for k, v in sent.items()} == {k: tuple(v.shape) for k, v in payload.items()}
        model = load_model(level_spec, sent, torch.device("cpu")).train()
        assert count_parameters(model) == expected  # the client trains what inspect counted
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.01).step()
        assert torch.isfinite(loss)
        assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())
    return params


def test_torchvision_models_inspect_and_train_every_level(one_thread):
    start = time.perf_counter()
    for name, head in TORCHVISION:
        _every_level_trains_as_a_client(
            [f"model.target=torchvision.models:{name}", "model.kwargs.num_classes=10", "dataset=cifar10", LEVELS], head
        )
    assert time.perf_counter() - start < 120  # the whole list (typically ~25 s on a shared 2-core CPU)


def test_a_users_groupnorm_cnn_inspects_and_trains_every_level(one_thread):
    params = _every_level_trains_as_a_client([*GN_CNN.split(), LEVELS], "head")
    assert len(params) == 3


def test_squeezenet_conv_head_stays_full_in_inspect_and_is_averaged_per_class(capsys):
    assert (
        main(["model.target=torchvision.models:squeezenet1_1", "model.kwargs.num_classes=10", "dataset=cifar10"]) == 0
    )
    out = capsys.readouterr().out
    assert "| classifier.1 |" not in out  # not in the plan: the logits layer is never factorized
    assert "| features.12.expand3x3 | Conv2d |" in out  # the layers before it are
    spec = {
        "arch": "custom",
        "target": "torchvision.models:squeezenet1_1",
        "kwargs": {"num_classes": 10},
        "num_classes": 10,
        "in_channels": 3,
        "image_size": 32,
    }
    with torch.device("meta"):
        model = build_model(spec)
    assert model.classifier_name == "classifier.1"
    assert classifier_keys(model) == ["classifier.1.weight", "classifier.1.bias"]
    with torch.device("meta"):  # head: true factorizes it (and ends the per-class averaging)
        factorized = build_model({**spec, "factorize": {"head": True}})
    assert factorized.classifier_name == "" and classifier_keys(factorized) == []


def test_mnasnet_loads_a_state_without_metadata_also_after_a_copy():
    import torchvision

    spec = {
        "arch": "custom",
        "target": "torchvision.models:mnasnet0_5",
        "kwargs": {"num_classes": 3},
        "num_classes": 3,
        "in_channels": 3,
        "image_size": 32,
    }
    with torch.device("meta"):
        plain = torchvision.models.mnasnet0_5(num_classes=3)
        with pytest.raises(ValueError, match="version should be set to 1 or 2"):  # what clients met
            plain.load_state_dict(dict(plain.state_dict()))
        model = build_model(spec, spectral_init=False)
    state = dict(model.state_dict())
    model.load_state_dict(state)
    copied = copy.deepcopy(model)  # the distillation teacher is a deep copy
    copied.load_state_dict(state)
    assert copied._load_from_state_dict.module is copied
    assert "_load_from_state_dict" not in vars(copied.layers[0])  # torch's own modules keep their loading
    small = {**spec, "target": "torchvision.models:MNASNet", "kwargs": {"alpha": 0.1, "num_classes": 3}}
    pickled = pickle.loads(pickle.dumps(build_model(small)))  # real weights, pickled with the loading fix
    pickled.load_state_dict(dict(build_model(small).state_dict()))


def test_the_check_refuses_what_a_client_could_not_load_or_train():
    cnn = "dataset=fashion_mnist model.kwargs.width=2"
    with pytest.raises(
        ConfigError,
        match=r"model\.target='tests\.tv_models:unloadable_cnn'; allowed: a factory whose "
        r"model loads its own state dict as clients receive it .*needs its own",
    ):
        load_config(f"model.target=tests.tv_models:unloadable_cnn {cnn}")
    with pytest.raises(
        ConfigError,
        match=r"model\.target='tests\.tv_models:pair_cnn'; .*returns the logits.*"
        r"it returned a tuple",
    ):
        load_config(f"model.target=tests.tv_models:pair_cnn {cnn}")
    load_config(f"model.target=tests.tv_models:gn_cnn {cnn}")  # the same CNN, plain: accepted
