"""FjORD (docs/METHODS.md#fjord): parity with Flower's ``baselines/fjord`` on the same weights (the width
slicing and the aggregation, written here from the reference's definitions), the client hook's
step against an explicitly sliced sub-model, the draws, the config check and a short run.

The reference (adap/flower, ``baselines/fjord/fjord``): ``od/layers/conv.py`` and ``linear.py`` cut
a layer to ``weight[:out_dim, :in_dim]`` with ``out_dim = int(np.ceil(width * p))`` (the
classifier, built with ``is_od=False``, keeps ``out_dim = width``) and ``in_dim`` the channels of
its input; ``od/layers/batch_norm.py`` cuts the affine ``weight[:in_dim]``, ``bias[:in_dim]``;
``od/samplers/fixed_od.py`` draws ``p = np.random.choice([p for p in p_s if p <= max_p])`` once per
forward; ``strategy.py`` (``fjord_average``) starts from the previous parameters and, for ``p`` in
``p_s`` from the largest down, sets each layer's ``[:out_dim, :in_dim]`` block (``[:out_dim]`` for
vectors) to ``Σ n_i w_i / Σ n_i`` over the clients with ``p_max >= p``; ``models.py`` (``train``)
with ``know_distill`` backpropagates ``CE(full, y)`` and then ``CE(partial, softmax(full))``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fedhm_flwr.config import ConfigError, load_config, model_spec, run_options
from fedhm_flwr.math import fjord, width
from fedhm_flwr.math.train import TrainOptions, client_hook, train_local
from fedhm_flwr.models import build_model
from fedhm_flwr.server.methods.method import Reply
from fedhm_flwr.server.registry import METHODS, STRATEGIES

P_S = [0.2, 0.4, 0.6, 0.8, 1.0]  # the paper's and the reference's uniform widths


def _method(extra: str = "", ratios: str = "[1,0.8,0.6,0.4,0.2]"):
    cfg = load_config(f"method=fjord model.width=8 levels.ratios={ratios} {extra}".split())
    return METHODS["fjord"](run_options(cfg), model_spec(cfg))


def _random_state(spec, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in build_model(spec).state_dict().items()}


# --------------------------------------------------------------------------- the reference, re-implemented


def reference_dims(model: nn.Module, p: float) -> dict[str, tuple[int, ...]]:
    """Per state key, the reference's slice at width ``p``: convs and the hidden linear keep
    ``ceil(width·p)`` outputs (np.ceil, no tolerance) and the channels of their input; the stem
    reads the image whole; the classifier keeps every output; a norm follows its channels."""
    classifier, dims = getattr(model, "classifier_name", "fc"), {}
    stem = next(n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            out_ch, in_ch = module.weight.shape[:2]
            out_dim = out_ch if name == classifier else int(np.ceil(out_ch * p))
            in_dim = in_ch if name == stem else int(np.ceil(in_ch * p))
            dims[f"{name}.weight"] = (out_dim, in_dim)
            if module.bias is not None:
                dims[f"{name}.bias"] = (out_dim,)
        elif isinstance(module, nn.BatchNorm2d):
            dims[f"{name}.weight"] = dims[f"{name}.bias"] = (int(np.ceil(module.num_features * p)),)
    return dims


def reference_average(previous, clients, num_examples, p_maxes, p_s, dims_at):
    """``fjord_average`` over full-shape client models (as the reference's clients send them)."""
    out = {}
    for key, prev in previous.items():
        update = prev.numpy().copy()
        for p in sorted(p_s, reverse=True):
            held = [i for i, pm in enumerate(p_maxes) if pm >= p]
            if not held:
                continue
            block = tuple(slice(0, d) for d in dims_at[p][key])
            total = sum(num_examples[i] * clients[i][key].numpy()[block] for i in held)
            update[block] = total / sum(num_examples[i] for i in held)
        out[key] = torch.from_numpy(update)
    return out


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("arch", ["model=cnn model.width=64", "model=resnet18 model.width=8"])
def test_the_width_slices_are_the_references(arch):
    cfg = load_config(f"method=fjord {arch} levels.ratios=[1,0.8,0.6,0.4,0.2]".split())
    method = METHODS["fjord"](run_options(cfg), model_spec(cfg))
    full = _random_state(method.spec, 0)
    for level, p_max in enumerate(method.rates):
        _, sent, options = method.level_payload(level, full)
        hook = options["hook_options"]
        assert options["hook"] == "fjord" and hook["p_values"] == [p for p in P_S if p <= p_max]
        dims = reference_dims(method._shapes_model, p_max)
        for key, tensor in sent.items():  # the p_max model sent = the reference's slice at p_max
            assert torch.equal(tensor, full[key][tuple(slice(0, d) for d in dims[key])]), key
        for p, sizes in zip(hook["p_values"], hook["sizes"]):  # each drawn width, cut from what was sent
            dims = reference_dims(method._shapes_model, p)
            cut = fjord.narrowed(sent, sizes)
            for key in sent:
                assert torch.equal(cut[key], full[key][tuple(slice(0, d) for d in dims[key])]), (p, key)


def test_the_aggregation_is_the_references_nested_average():
    method = _method()
    shapes_model = method._shapes_model
    previous = _random_state(method.spec, 1)
    p_maxes, counts = [1.0, 0.8, 0.6, 0.6, 0.2, 0.4], [30, 7, 12, 5, 40, 9]
    clients = [_random_state(method.spec, 10 + i) for i in range(len(p_maxes))]  # full shape, as the reference's
    dims_at = {p: reference_dims(shapes_model, p) for p in P_S}
    expected = reference_average(previous, clients, counts, p_maxes, P_S, dims_at)
    replies = []
    for i, (p_max, n) in enumerate(zip(p_maxes, counts)):
        level = method.rates.index(p_max)
        sent = width.slice_state(clients[i], method.plan(level))
        replies.append(Reply(i, level, p_max, sent, n, np.full(10, 3), {}))
    merged = method.merge(1, previous, replies)
    for key in previous:
        assert torch.allclose(merged[key], expected[key], rtol=1e-6, atol=1e-6), key
    # elements no client holds keep their values: without a full-width client, beyond 0.8's block
    merged = method.merge(1, previous, replies[1:])
    out = dims_at[0.8]["conv2.weight"][0]
    assert torch.equal(merged["conv2.weight"][out:], previous["conv2.weight"][out:])


# --------------------------------------------------------------------------- the client hook


def _one_batch(spec, n: int = 16, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec["in_channels"], spec["image_size"], spec["image_size"])
    return TensorDataset(torch.randn(shape, generator=g), torch.arange(n) % spec["num_classes"])


def _trained(spec, state, options: TrainOptions, dataset) -> dict[str, torch.Tensor]:
    model = build_model(spec, spectral_init=False)
    model.load_state_dict(state)
    train_local(model, dataset, options, torch.device("cpu"), seed=3)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("p", [0.2, 0.4])
def test_one_hook_step_is_the_step_of_the_sliced_sub_model_scattered_back(p):
    method = _method()
    level = method.rates.index(0.6)
    spec, sent, options = method.level_payload(level, _random_state(method.spec, 2))
    hook = options["hook_options"]
    at = hook["p_values"].index(p)
    one = {"p_values": [p], "sizes": [hook["sizes"][at]], "distill": False}
    train = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, batch_size=16, masked_ce=False)
    data = _one_batch(spec)
    hooked = _trained(spec, sent, TrainOptions(**train, hook="fjord", hook_options=one), data)
    sub_spec = width.submodel_spec(method.spec, p, scaler=False)  # the width-p model, built explicitly
    sub = _trained(sub_spec, width.slice_state(sent, method.width_plan(p)), TrainOptions(**train), data)
    for key, value in hooked.items():
        block = tuple(slice(0, d) for d in one["sizes"][0][key])
        assert torch.allclose(value[block], sub[key], rtol=1e-5, atol=1e-6), key
        outside = torch.ones_like(value, dtype=torch.bool)
        outside[block] = False  # zero gradient there: SGD's first step only decays the weight
        decayed = sent[key].add(sent[key] * 5e-4, alpha=-0.1)
        assert torch.allclose(value[outside], decayed[outside], rtol=0, atol=1e-7), key


def test_the_hook_at_p_max_alone_trains_as_the_plain_client():
    method = _method()
    spec, sent, options = method.level_payload(method.rates.index(0.6), _random_state(method.spec, 2))
    hook = options["hook_options"]
    top = {"p_values": hook["p_values"][-1:], "sizes": hook["sizes"][-1:], "distill": False}
    data = _one_batch(spec, n=48)
    hooked = _trained(spec, sent, TrainOptions(batch_size=16, hook="fjord", hook_options=top), data)
    plain = _trained(spec, sent, TrainOptions(batch_size=16), data)
    for key in plain:
        assert torch.allclose(hooked[key], plain[key], rtol=1e-6, atol=1e-7), key


def test_widths_are_drawn_uniformly_up_to_p_max_and_only_the_drawn_width_gets_gradients():
    assert fjord.allowed_widths(P_S, 0.6) == [0.2, 0.4, 0.6]
    with pytest.raises(ValueError, match=r"p_max=0\.1"):
        fjord.allowed_widths(P_S, 0.1)
    g = torch.Generator().manual_seed(0)
    counts = np.bincount([fjord.draw_width(3, g) for _ in range(6000)], minlength=3)
    assert counts.sum() == 6000 and np.all(np.abs(counts - 2000) < 150), counts
    method = _method()
    torch.manual_seed(0)  # the model's own initialisation (norms at weight 1, bias 0: no dead channel)
    spec, sent, options = method.level_payload(method.rates.index(0.8), build_model(method.spec).state_dict())
    model = build_model(spec, spectral_init=False)
    model.load_state_dict(sent)
    step = fjord.train_hook(model, options["hook_options"], seed=4)
    x, y = _one_batch(spec).tensors
    seen = set()
    for _ in range(12):
        model.zero_grad()
        loss, logits = step(x, y, F.cross_entropy)
        loss.backward()
        seen.add(int((model.conv4.weight.grad.abs().sum((1, 2, 3)) > 0).sum()))  # output channels trained
        assert logits.shape == (16, 10)
    full_out = model.conv4.weight.shape[0]  # 0.8 of 64 channels: each draw trains ceil(p·64) of them
    assert seen <= {math.ceil(p * 64) for p in (0.2, 0.4, 0.6, 0.8)} and len(seen) >= 3 and max(seen) <= full_out


def test_distillation_is_the_references_two_losses():
    method = _method("method.distill=true")
    spec, sent, options = method.level_payload(method.rates.index(0.8), _random_state(method.spec, 2))
    assert options["hook_options"]["distill"] is True
    sizes = options["hook_options"]["sizes"][1]
    model = build_model(spec, spectral_init=False)
    model.load_state_dict(sent)
    x, y = _one_batch(spec).tensors
    loss, _ = fjord.fjord_step(model, x, y, F.cross_entropy, sizes, distill=True)
    loss.backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    full = model(x)  # the reference: backward of CE(full, y), then of CE(partial, softmax(full))
    F.cross_entropy(full, y).backward()
    partial = torch.func.functional_call(model, fjord.narrowed(dict(model.named_parameters()), sizes), (x,))
    F.cross_entropy(partial, full.detach().softmax(dim=1)).backward()
    for k, p in model.named_parameters():
        assert torch.allclose(ours[k], p.grad, rtol=1e-5, atol=1e-7), k


# --------------------------------------------------------------------------- refusals and the run


def test_bad_fjord_options_and_hooks_are_refused_naming_them():
    with pytest.raises(ConfigError) as err:
        load_config(["method=fjord", "levels.ratios=[1,0.5]", "method.p_values=[0.25,1]"])
    assert err.value.field == "method.p_values"
    with pytest.raises(ConfigError) as err:
        load_config(["method=fjord", "method.p_values=[1,0.5]", "levels.match=fedhm_params"])
    assert err.value.field == "method.p_values" and "levels.match" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(["method=fjord", "method.distill=maybe"])
    assert err.value.field == "method.distill"
    with pytest.raises(ConfigError) as err:
        load_config(["method=fjord", "model=vit"])
    assert err.value.field == "model.arch"
    for name in ("nope", "train", "../x", "os"):  # only a module of fedhm_flwr.math with a train_hook
        with pytest.raises(ValueError, match="hook="):
            client_hook(name, nn.Linear(2, 2), {}, 0)
    assert STRATEGIES["fjord"].__name__ == "FjORDStrategy"


@pytest.mark.slow
def test_fjord_runs_in_process_and_learns(tmp_path):
    from inprocess_helpers import small_run

    examples = ["dataset.max_train_examples=1600", "dataset.max_test_examples=400", "evaluation.batch_size=400"]
    summary = small_run(tmp_path, "method=fjord", "levels.ratios=[1,0.5,0.25]", *examples)
    assert summary["final_acc/global"] > 0.3, summary  # 10 classes: chance is 0.1
