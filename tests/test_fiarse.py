"""FIARSE (docs/METHODS.md#fiarse): parity with the official code (HarliWu/FIARSE, ``fiarse/``) on the
same weights: the extraction at each size, one client's local steps and the server's update, each
written here from the official definitions; the costs, the config check and a short run.

The official code, as re-stated here:

* ``model/resnet_masked.py`` ``BetaResNet.generate_mask(model_size, topk=True)``: ``scores =
  |to_vector('param')|``, the weights and biases of every ``MaskedConv2d`` / ``MaskedLinear``
  concatenated (norm layers have ``size = 0`` and are not in it); ``threshold =
  torch.topk(scores, k=int(numel*model_size)).values[-1]``, set on every masked layer.
* ``model/model_utils.py`` ``MaskedConv2d.forward`` / ``MaskedLinear.forward``: ``weight *
  Bern.apply(|weight|, threshold)`` (bias likewise), where ``Bern.forward`` returns ``scores >=
  threshold``, a bool tensor, and ``Bern.backward`` is ``grad_output · 2θ/(scores+θ)² · mask``.
* the client (``worker.py`` ``local_training``): ``torch.optim.SGD(lr)`` on a deep copy of the
  global model (every value, the threshold fixed), ``CrossEntropyLoss``; it returns
  ``cache_param - cur_param`` for every state key.
* ``server.py`` ``simulation_exp``: ``tot_grad += grad``, ``tot_mask += (grad != 0)`` over the
  participants; ``avg = nan_to_num(tot_grad / tot_mask)``; ``params -= lr_global * avg`` (running
  statistics: ``params - avg``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import TensorDataset

from fedhm_flwr.config import ConfigError, load_config, model_spec, run_options
from fedhm_flwr.config.options import fiarse as fiarse_options
from fedhm_flwr.math import fiarse
from fedhm_flwr.math.train import TrainOptions, train_local
from fedhm_flwr.models import build_model, input_shape, shape_device
from fedhm_flwr.models.costs import model_costs
from fedhm_flwr.server.methods.method import Reply
from fedhm_flwr.server.registry import METHODS, STRATEGIES

SIZES = "[1,0.25,0.0625,0.015625]"  # the paper's {1, 1/4, 1/16, 1/64}


def _method(extra: str = "", arch: str = "model=cnn model.width=8"):
    cfg = load_config(f"method=fiarse {arch} levels.ratios={SIZES} {extra}".split())
    return METHODS["fiarse"](run_options(cfg), model_spec(cfg))


def _random_state(spec, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in build_model(spec).state_dict().items()}


# --------------------------------------------------------------------------- the official code, re-stated


def official_masked_keys(model: nn.Module) -> list[str]:
    """The parameters of the official masked layers: Conv2d and Linear weights and biases."""
    layers = {n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    return [k for k, _ in model.named_parameters() if k.rsplit(".", 1)[0] in layers]


def official_threshold(state, keys, size: float) -> float:
    """``torch.topk(scores, k=int(numel*size)).values[-1]`` of the concatenated ``|w|``."""
    scores = np.abs(np.concatenate([state[k].numpy().ravel() for k in keys]))
    k = int(scores.size * size)
    return float(np.sort(scores)[::-1][k - 1])


class OfficialBern(torch.autograd.Function):
    """``Bern`` as the official code writes it (a bool forward: autograd never calls the backward)."""

    @staticmethod
    def forward(ctx, scores, threshold):
        ctx.save_for_backward(scores, threshold)
        return scores >= threshold

    @staticmethod
    def backward(ctx, grad_output):
        scores, threshold = ctx.saved_tensors
        grad = torch.nan_to_num(2 * threshold / torch.pow(scores + threshold, 2), nan=0.0, posinf=0.0, neginf=0.0)
        return grad_output * grad * (scores >= threshold), None


class FloatBern(OfficialBern):
    """The same ``Bern`` with a float forward, so that its written backward runs."""

    @staticmethod
    def forward(ctx, scores, threshold):
        ctx.save_for_backward(scores, threshold)
        return (scores >= threshold).float()


class OfficialMask(nn.Module):
    """``weight * Bern.apply(|weight|, threshold)``, as a parametrization of the layer's tensor."""

    def __init__(self, threshold: float, bern: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.threshold, self.bern = torch.tensor(threshold), bern

    def forward(self, weight):
        return weight * self.bern.apply(torch.abs(weight), self.threshold)


def official_local_training(spec, state, theta, x, y, lr: float, steps: int, bern=OfficialBern):
    """The official client on the full global model: SGD(lr), cross-entropy, ``steps`` batches;
    returns the trained state (its ``cache - cur`` is the official update)."""
    model = build_model(spec, spectral_init=False)
    model.load_state_dict(state)
    for key in official_masked_keys(model):
        module_name, tensor = key.rsplit(".", 1)
        parametrize.register_parametrization(model.get_submodule(module_name), tensor, OfficialMask(theta, bern))
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        for key in official_masked_keys(build_model(spec, spectral_init=False)):
            module_name, tensor = key.rsplit(".", 1)
            parametrize.remove_parametrizations(model.get_submodule(module_name), tensor, leave_parametrized=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def official_server_update(global_state, client_updates, lr_global: float):
    """``simulation_exp``'s update from the clients' ``cache - cur``."""
    out = {}
    for name, param in global_state.items():
        tot_grad, tot_mask = torch.zeros_like(param), torch.zeros_like(param)
        for grad in client_updates:
            tot_grad += grad[name]
            tot_mask += grad[name] != 0
        avg = torch.nan_to_num(tot_grad / tot_mask, nan=0.0, posinf=0.0, neginf=0.0)
        out[name] = param - avg if "running" in name else param - lr_global * avg
    return out


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("arch", ["model=cnn model.width=8", "model=resnet18 model.width=8"])
def test_the_extraction_at_each_size_is_the_officials(arch):
    method = _method(arch=arch)
    full = _random_state(method.spec, 0)
    keys = official_masked_keys(build_model(method.spec))
    assert method.keys == keys
    numel = sum(full[k].numel() for k in keys)
    for level, size in enumerate(method.levels):
        spec, sent, options = method.level_payload(level, full)
        theta = official_threshold(full, keys, size)
        assert spec == method.spec and options["hook"] == "fiarse"
        assert options["hook_options"] == {"threshold": theta, "gradient": "masked"}
        kept = 0
        for key, value in full.items():
            if key in keys:
                mask = value.abs() >= theta
                kept += int(mask.sum())
                assert torch.equal(sent[key], torch.where(mask, value, torch.zeros_like(value))), (size, key)
            else:  # norms travel whole
                assert torch.equal(sent[key], value), (size, key)
        assert kept == int(numel * size)  # random normal weights: no tie at the threshold
        if size == 1:
            assert all(torch.equal(sent[k], full[k]) for k in full)


def test_the_aggregation_is_the_officials_update():
    method = _method("method.server_lr=0.7")
    global_state = _random_state(method.spec, 1)
    keys = set(method.keys)
    levels, counts = [0, 1, 1, 2, 3], [30, 7, 12, 5, 40]  # sample counts must not matter
    replies, official = [], []
    for i, level in enumerate(levels):
        theta = official_threshold(global_state, sorted(keys), method.levels[level])
        g = torch.Generator().manual_seed(20 + i)
        trained_official, trained_here = {}, {}
        for key, value in global_state.items():
            new = value + 0.1 * torch.randn(value.shape, generator=g)
            if key in keys:
                mask = value.abs() >= theta
                if i == 1:  # a client that left some of its elements unchanged: they do not count
                    mask_changed = mask & (torch.rand(value.shape, generator=g) < 0.5)
                    new = torch.where(mask_changed, new, value)
                trained_official[key] = torch.where(mask, new, value)  # official: masked-out values stay
                trained_here[key] = torch.where(mask, new, torch.zeros_like(value))  # here: zeros stay zeros
            else:
                trained_official[key] = trained_here[key] = new
        official.append({k: global_state[k] - trained_official[k] for k in global_state})
        replies.append(Reply(i, level, method.levels[level], trained_here, counts[i], np.full(10, 3), {}))
    expected = official_server_update(global_state, official, lr_global=0.7)
    merged = method.merge(1, global_state, replies)
    for key in global_state:
        assert torch.allclose(merged[key], expected[key], rtol=1e-6, atol=1e-6), key
    # an element no client kept keeps its value: the smallest size alone
    small = [r for r in replies if r.level_index == 3]
    merged = method.merge(1, global_state, small)
    theta = official_threshold(global_state, sorted(keys), method.levels[3])
    outside = global_state["conv2.weight"].abs() < theta
    assert outside.any() and torch.equal(merged["conv2.weight"][outside], global_state["conv2.weight"][outside])


def _batch(spec, n: int = 16, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec["in_channels"], spec["image_size"], spec["image_size"])
    return torch.randn(shape, generator=g), torch.arange(n) % spec["num_classes"]


@pytest.mark.parametrize(("gradient", "bern"), [("masked", OfficialBern), ("bern", FloatBern)])
def test_local_steps_are_the_official_clients(gradient, bern):
    """Three SGD steps through the shared client with the hook = the official client's on the full
    model: the same update inside the mask, none outside (the official keeps the masked-out values,
    here they are zeros and stay zeros). ``masked`` is what the official code computes; ``bern``
    what its ``Bern`` backward is written to compute."""
    method = _method(f"method.gradient={gradient}")
    torch.manual_seed(0)
    global_state = build_model(method.spec).state_dict()
    level = 1  # size 1/4
    spec, sent, options = method.level_payload(level, global_state)
    theta = options["hook_options"]["threshold"]
    x, y = _batch(spec)
    lr = 0.5
    model = build_model(spec, spectral_init=False)
    model.load_state_dict(sent)
    train = TrainOptions(
        lr=lr,
        momentum=0.0,
        weight_decay=0.0,
        batch_size=16,
        local_epochs=3,
        masked_ce=False,
        hook="fiarse",
        hook_options=options["hook_options"],
    )
    train_local(model, TensorDataset(x, y), train, torch.device("cpu"), seed=3)
    here = model.state_dict()
    reference = official_local_training(spec, global_state, theta, x, y, lr, steps=3, bern=bern)
    moved = 0
    for key, start in global_state.items():
        official_update = start - reference[key]
        update = sent[key] - here[key]
        assert torch.allclose(update, official_update, rtol=1e-4, atol=1e-6), key
        if key in method.keys:
            outside = start.abs() < theta
            assert torch.equal(here[key][outside], torch.zeros_like(here[key][outside])), key
            moved += int((update != 0).sum())
    assert 0 < moved  # the steps did train the kept elements


def test_the_bern_gradient_is_the_written_backward():
    w = torch.tensor([0.5, -0.2, 0.05, -0.1], requires_grad=True)
    theta = 0.1
    (fiarse.masked_weight(w, theta, "bern") * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = (w.detach().abs() >= theta).float()
    expected = g * m * (1 + 2 * theta * w.detach().abs() / (w.detach().abs() + theta) ** 2)
    assert torch.allclose(w.grad, expected)
    w.grad = None
    (fiarse.masked_weight(w, theta, "masked") * g).sum().backward()
    assert torch.equal(w.grad, g * m)


# --------------------------------------------------------------------------- costs, refusals, the run


def test_costs_count_the_full_shape_tensors_a_device_holds():
    method = _method()
    with shape_device(method.spec):  # as the costs are counted: shapes only
        model = build_model(method.spec, spectral_init=False)
        dense = model_costs(model, input_shape(method.spec), method.opts.train.batch_size, method.opts.train.momentum)
    keys = official_masked_keys(model)
    masked = sum(p.numel() for k, p in model.named_parameters() if k in keys)
    weights = sum(p.numel() for k, p in model.named_parameters() if k in keys and k.endswith(".weight"))
    for level, size in enumerate(method.levels):
        cost = method.level_cost(level)
        assert cost["params"] == dense["params"] and cost["macs"] == dense["macs"]  # dense kernels skip nothing
        assert cost["bytes"] == dense["bytes"]  # full-shape arrays on the wire
        # + what autograd keeps of the masked forward: each masked weight in float32 (the conv or linear
        # saves it) and every mask as bool (test_the_masked_forward_keeps_what_the_memory_counts)
        assert cost["memory"] == dense["memory"] + 4 * weights + masked
        assert cost["kept_params"] == dense["params"] - masked + int(masked * size)


def test_parameter_matched_sizes_keep_fedhms_parameters_at_each_rank_ratio():
    gammas = "[1.0,0.5,0.25,0.125]"
    cfg = load_config(f"method=fiarse model=cnn model.width=8 levels.ratios={gammas} levels.match=fedhm_params".split())
    method = METHODS["fiarse"](run_options(cfg), model_spec(cfg))
    fedhm_cfg = load_config(f"method=fedhm model=cnn model.width=8 levels.ratios={gammas}".split())
    fedhm = METHODS["fedhm"](run_options(fedhm_cfg), model_spec(fedhm_cfg))  # FedHM's own count of its levels
    with shape_device(method.spec):
        model = build_model(method.spec, spectral_init=False)
    masked = sum(p.numel() for k, p in model.named_parameters() if k in official_masked_keys(model))
    for level in range(4):
        target = fedhm.level_cost(level)["params"]
        cost = method.level_cost(level)
        assert cost["fedhm_params"] == target
        # the kept count misses FedHM's by less than one masked element (int() rounds the size's share down)
        assert target - 1 <= cost["kept_params"] <= target, (level, cost["kept_params"], target)
        assert cost["params"] == method.level_cost(0)["params"]  # still dense on the device
    assert method.sizes[0] == 1.0 and method.sizes == sorted(method.sizes, reverse=True) and method.sizes[-1] < 0.25
    assert int(masked * method.sizes[1]) < masked


def test_the_masked_forward_keeps_what_the_memory_counts():
    """Beyond the input (an activation, counted with the dense model), autograd keeps each masked
    weight in float32 and each mask as bool; nothing of full size in float32 besides."""
    conv, x = nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8)
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fiarse.masked_forward(conv, x, ["weight", "bias"], 0.1, "masked")
    weight, bias = (4, 3, 3, 3), (4,)
    assert sorted(saved, key=str) == sorted(
        [(torch.bool, weight), (torch.bool, bias), (torch.float32, weight), (torch.float32, (2, 3, 8, 8))], key=str
    )


def test_bad_fiarse_options_are_refused_naming_them():
    for override, field in [
        ("method.gradient=straight", "method.gradient"),
        ("method.server_lr=0", "method.server_lr"),
        ("levels.match=fedhm_macs", "levels.match"),
        ("levels.match=fedhm_memory", "levels.match"),
        ("model=vit", "model.arch"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(["method=fiarse", override])
        assert err.value.field == field, override
    with pytest.raises(ValueError, match="gradient="):
        fiarse.train_hook(nn.Linear(2, 2), {"threshold": 0.1, "gradient": "straight"}, 0)
    assert fiarse_options.GRADIENTS == fiarse.GRADIENTS  # the torch-free copy of the rules
    assert STRATEGIES["fiarse"].__name__ == "FIARSEStrategy"


@pytest.mark.slow
def test_fiarse_runs_in_process_and_learns(tmp_path):
    from inprocess_helpers import small_run

    examples = ["dataset.max_train_examples=800", "dataset.max_test_examples=200", "evaluation.batch_size=200"]
    summary = small_run(tmp_path, "method=fiarse", "levels.ratios=[1,0.25]", *examples)
    assert summary["final_acc/global"] > 0.3, summary  # 10 classes: chance is 0.1
