"""Transformer track: packaged MiniLM, sentiment data, ViT backbones, FedLoRA and HeteroTune rounds.

Fast tests use tiny seeded random backbones; only the reference test loads the packaged MiniLM.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from fedhm_flwr.config import ConfigError, load_config, model_spec
from fedhm_flwr.data import client_dataset, make_data_spec, test_dataset
from fedhm_flwr.data.text import load_corpus, partition_indices, split_indices
from fedhm_flwr.math.aggregation import level_weights
from fedhm_flwr.math.cmga import default_scale
from fedhm_flwr.math.lora import lora_rank
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import federated_keys, load_federated, trainable_state
from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.server_app import run
from fedhm_flwr.server.registry import STRATEGIES
from fedhm_flwr.server.strategy import Reply

TINY_TEXT = (
    "model=minilm dataset=sentiment model.backbone=random model.width=32 model.depth=2 model.heads=2 "
    "num_clients=4 fraction_train=1.0 dataset.max_train_examples=160 dataset.max_test_examples=64 "
    "rounds=1 train.batch_size=16 evaluation.batch_size=64"
)
TINY_IMAGE = (
    "model=vit dataset=fashion_mnist model.backbone=random model.width=16 model.depth=2 "
    "num_clients=4 fraction_train=1.0 dataset.max_train_examples=400 dataset.max_test_examples=100 "
    "rounds=1 train.batch_size=32 evaluation.batch_size=100"
)
HETERO = "levels.ratios=[1,0.5] levels.proportions=[1,1] method.bottleneck=8"


def _strategy(overrides: str):
    cfg = load_config(overrides)
    return cfg, STRATEGIES[cfg.method.name](cfg, model_spec(cfg))


def _configure(strategy, grid, state, rnd=1):
    return list(strategy.configure_train(rnd, ArrayRecord.from_torch_state_dict(state), None, grid))


# ------------------------------------------------------------------------------------ MiniLM


def test_packaged_minilm_reproduces_the_sentence_transformers_reference_similarities():
    """The sentence-transformers documentation lists these cosine similarities for all-MiniLM-L6-v2
    (mean pooling): our hand-written encoder over the wheel's safetensors reproduces them."""
    from fedhm_flwr.data.text import tokenize
    from fedhm_flwr.models.text import PACKAGE_BACKBONE

    model = build_model({"arch": "minilm", "num_classes": 2, "backbone": PACKAGE_BACKBONE}).eval()
    pairs = [
        ("The new movie is awesome", "The new movie is so great", 0.8939),
        ("The cat sits outside", "The dog plays in the garden", 0.2838),
        ("A man is playing guitar", "A woman watches TV", -0.0327),
    ]
    ids = tokenize([s for a, b, _ in pairs for s in (a, b)], 32)
    with torch.no_grad():
        emb = torch.nn.functional.normalize(model.features(ids), dim=1)
    for k, (_, _, expected) in enumerate(pairs):
        assert float(emb[2 * k] @ emb[2 * k + 1]) == pytest.approx(expected, abs=1e-3)
    assert set(model.local_keys) == {k for k in model.state_dict() if not k.startswith("head.")}


# ------------------------------------------------------------------------------------ data


def test_sentiment_is_binary_deduplicated_and_split_without_overlap():
    texts, labels = load_corpus("sentiment")
    assert set(np.unique(labels)) == {0, 1} and len(set(texts)) == len(texts)
    train, test = split_indices("sentiment", "train"), split_indices("sentiment", "test")
    assert not set(train) & set(test) and len(train) + len(test) == len(texts)
    assert abs(labels[test].mean() - labels[train].mean()) < 0.002  # stratified
    spec = make_data_spec("sentiment", 1, max_test_examples=50)
    ds = test_dataset(spec)
    assert len(ds) == 50 and ds.ids.dtype == torch.int64 and bool((ds.ids[:, 0] == 101).all())  # [CLS]
    lengths = (ds.ids != 0).sum(1)
    assert bool((lengths[1:] >= lengths[:-1]).all())  # sorted by length for cheap evaluation


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_sentiment_partitions_cover_the_subset_disjointly(scheme):
    spec = make_data_spec("sentiment", 5, scheme=scheme, alpha=0.3, max_train_examples=500, seed=3)
    parts = partition_indices(spec)
    joined = np.concatenate(parts)
    assert len(joined) == 500 == len(set(joined.tolist()))
    assert [len(p) for p in parts] == [len(p) for p in partition_indices(spec)]  # seeded
    ds = client_dataset(spec, 2)
    assert len(ds) == len(parts[2]) and ds.class_counts().sum() == len(ds)


# ------------------------------------------------------------------------------------ ViT backbones


def test_vit_backbone_cache_round_trip_and_refusals(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from fedhm_flwr.models.vit import arch_of, backbone_keys, checkpoint_name, checkpoint_ref, new_vit

    monkeypatch.setenv("FEDHM_CACHE", str(tmp_path))
    spec = {"arch": "vit", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 16, "depth": 2}
    ref = checkpoint_ref(arch_of(spec))
    with pytest.raises(FileNotFoundError, match="make pretrain"):
        build_model({**spec, "backbone": ref})
    trained = new_vit({**spec, "num_classes": 5}, seed=7)
    state = trained.state_dict()
    (tmp_path / "vit").mkdir()
    meta = {k: str(v) for k, v in arch_of(spec).items()}
    save_file(
        {k: state[k] for k in backbone_keys(trained)},
        str(tmp_path / "vit" / checkpoint_name(arch_of(spec))),
        metadata=meta,
    )
    model = build_model({**spec, "backbone": ref})
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in model.local_keys)
    assert model.head.out_features == 10  # the source head is not part of the backbone
    save_file(
        {k: state[k] for k in backbone_keys(trained)},
        str(tmp_path / "vit" / checkpoint_name({**arch_of(spec), "depth": 3})),
        metadata=meta,
    )
    with pytest.raises(ValueError, match="does not match"):
        build_model({**spec, "depth": 3, "backbone": checkpoint_ref({**arch_of(spec), "depth": 3})})
    shallow = build_model({**spec, "depth": 1, "backbone": ref})  # fewer blocks: the leading ones are loaded
    assert len(shallow.blocks) == 1 and all(torch.equal(shallow.state_dict()[k], state[k]) for k in shallow.local_keys)
    with pytest.raises(ValueError, match="relative path"):
        build_model({**spec, "backbone": "cache:../outside.safetensors"})


@pytest.mark.parametrize(
    "spec",
    [
        {"arch": "vit", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 16, "depth": 2},
        {"arch": "minilm", "num_classes": 2, "width": 32, "depth": 1, "heads": 2},
    ],
)
def test_random_backbones_are_identical_on_every_node(spec):
    a = build_model({**spec, "backbone": "random", "backbone_seed": 5, "lora": {"rank": 2}})
    torch.manual_seed(123)  # another node's global RNG state must not matter
    b = build_model({**spec, "backbone": "random", "backbone_seed": 5, "lora": {"rank": 2}})
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.local_keys)
    c = build_model({**spec, "backbone": "random", "backbone_seed": 6})
    assert not all(torch.equal(a.state_dict()[k], c.state_dict()[k]) for k in c.local_keys)


# ------------------------------------------------------------------------------------ what trains


def _grads_after_backward(spec, state, x):
    model = build_model(spec)
    load_federated(model, state) if spec.get("trainable_only") else model.load_state_dict(state)
    model.train()
    model(x).sum().backward()
    return model, {k for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("track", ["text", "image"])
def test_only_the_intended_parameters_get_gradients_at_each_client_type(track):
    base = TINY_TEXT if track == "text" else TINY_IMAGE
    x = torch.randint(1000, 2000, (3, 12)) if track == "text" else torch.randn(3, 1, 28, 28)
    # FedLoRA, every rank: LoRA factors of Q, K, V, O and the head
    cfg, strategy = _strategy(f"method=fedlora {base} method.max_rank=4")
    state = strategy.method.initial_state(0)
    for i in range(len(strategy.levels)):
        spec, payload, _ = strategy.method.level_payload(i, state)
        model, grads = _grads_after_backward(spec, payload, x)
        assert grads == set(payload) == set(trainable_state(model))
        assert all(k.endswith(("lora_A", "lora_B")) or k.startswith("head.") for k in grads)
        assert len([k for k in grads if k.endswith("lora_A")]) == len(model.lora_targets())
        assert payload[next(k for k in payload if k.endswith("lora_A"))].shape[0] == strategy.method.ranks[i]
    # full fine-tuning: everything
    cfg, strategy = _strategy(f"method=fedlora method.mode=full {base} levels.ratios=[1] levels.proportions=[1]")
    spec, payload, _ = strategy.method.level_payload(0, strategy.method.initial_state(0))
    model, grads = _grads_after_backward(spec, payload, x)
    assert grads == {k for k, _ in model.named_parameters()}
    # HeteroTune: local adapters, gates, own share-adapters, head; other types' shares frozen
    cfg, strategy = _strategy(f"method=heterotune {base} {HETERO}")
    state = strategy.method.initial_state(0)
    for i in range(2):
        spec, payload, _ = strategy.method.level_payload(i, state)
        model, grads = _grads_after_backward(spec, payload, x)
        shares = {k for k in payload if ".share_" in k}
        assert shares and {k for k in grads if ".share_" in k} == {k for k in shares if k.endswith(f".{i}")}
        assert grads == set(strategy.method.reply_keys(i, spec, payload)) == set(trainable_state(model))
        assert all(k.startswith(("adapters.", "head.")) for k in grads)
        assert any(".gate_pre" in k for k in grads) and any(".down." in k for k in grads)
    # Homo-Training: no bank at all
    cfg, strategy = _strategy(f"method=heterotune method.bank=false {base} {HETERO}")
    spec, payload, _ = strategy.method.level_payload(1, strategy.method.initial_state(0))
    _, grads = _grads_after_backward(spec, payload, x)
    assert grads == set(payload) and not any(".share_" in k or ".gate_" in k for k in grads)


def test_load_federated_refuses_backbone_tensors_and_missing_adapters():
    spec = {
        "arch": "vit",
        "num_classes": 10,
        "in_channels": 1,
        "image_size": 28,
        "width": 16,
        "depth": 1,
        "backbone": "random",
        "lora": {"rank": 2},
        "trainable_only": True,
    }
    model = build_model(spec)
    state = {k: v for k, v in model.state_dict().items() if k in set(federated_keys(model))}
    load_federated(build_model(spec), state)
    with pytest.raises(ValueError, match="unexpected"):
        load_federated(build_model(spec), {**state, "patch_embed.weight": model.patch_embed.weight.detach()})
    with pytest.raises(ValueError, match="missing"):
        load_federated(build_model(spec), {k: v for k, v in state.items() if not k.endswith("lora_B")})


# ------------------------------------------------------------------------------------ FedLoRA


def test_fedlora_messages_carry_only_factors_and_head_and_hand_out_the_truncation():
    cfg, strategy = _strategy(f"method=fedlora {TINY_IMAGE} method.max_rank=4")
    assert strategy.method.ranks == [4, 2, 1, 1]
    state = strategy.method.initial_state(0)
    assert not set(state) & set(build_model(strategy.method.spec).local_keys)  # no backbone in the global state
    g = torch.Generator().manual_seed(0)
    for t in strategy.method.targets:  # a non-trivial ΔW of rank 3
        k = f"{t}.lora_delta"
        state[k] = torch.randn(state[k].shape[0], 3, generator=g) @ torch.randn(3, state[k].shape[1], generator=g)
    grid = LocalGrid(4, client_handlers())
    messages = _configure(strategy, grid, state)
    # every record travels and counts: the arrays and the training config
    assert strategy.round_log.sent_bytes == sum(r.count_bytes() for m in messages for r in m.content.values())
    for msg in messages:
        config = msg.content["config"]
        spec = json.loads(config["model-spec"])
        rank = strategy.method.ranks[config["level-index"]]
        got = msg.content["arrays"].to_torch_state_dict()
        assert spec["trainable_only"] and spec["lora"] == {"rank": rank}
        assert set(got) == set(federated_keys(build_model(spec)))
        t = strategy.method.targets[0]
        delta = state[f"{t}.lora_delta"].double()
        S = torch.linalg.svdvals(delta)
        err = delta - got[f"{t}.lora_B"].double() @ got[f"{t}.lora_A"].double()
        assert float(torch.linalg.norm(err)) == pytest.approx(float(S[rank:].pow(2).sum().sqrt()), abs=1e-4)


def test_fedlora_merge_is_the_fedhm_weighted_sum_of_products():
    cfg, strategy = _strategy(f"method=fedlora {TINY_IMAGE} method.max_rank=4")
    state = strategy.method.initial_state(0)
    g = torch.Generator().manual_seed(1)
    replies = []
    for i in (0, 1, 3):
        _, payload, _ = strategy.method.level_payload(i, state)
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in payload.items()}
        counts = np.array([5] * 10)
        replies.append(Reply(i, i, strategy.levels[i], trained, 50, counts, {}))
    new = strategy.method.merge(1, state, replies)
    w = level_weights([r.level for r in replies], 1.0)
    t = strategy.method.targets[-1]
    want = sum(wi * r.state[f"{t}.lora_B"].double() @ r.state[f"{t}.lora_A"].double() for wi, r in zip(w, replies))
    assert torch.allclose(new[f"{t}.lora_delta"].double(), want, atol=1e-5)
    assert torch.allclose(
        new["head.bias"].double(), sum(wi * r.state["head.bias"].double() for wi, r in zip(w, replies)), atol=1e-6
    )
    assert set(new) == set(state)


# ------------------------------------------------------------------------------------ HeteroTune


@pytest.mark.parametrize("track", ["text", "image"])
def test_heterotune_deployable_model_equals_the_trained_dema_model(track):
    """The server's exact merge: the deployable type-i model (bank merged into plain adapters)
    computes what the type-i training model computes."""
    base = TINY_TEXT if track == "text" else TINY_IMAGE
    cfg, strategy = _strategy(f"method=heterotune {base} {HETERO}")
    state = strategy.method.initial_state(0)
    g = torch.Generator().manual_seed(2)
    state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in state.items()}  # non-trivial everything
    x = torch.randint(1000, 2000, (4, 10)) if track == "text" else torch.randn(4, 1, 28, 28)
    for i in range(2):
        spec, payload, _ = strategy.method.level_payload(i, state)
        trained = build_model(spec)
        load_federated(trained, payload)
        dspec, dstate = strategy.method.deployable(i, state)
        deployed = build_model(dspec)
        load_federated(deployed, dstate)
        with torch.no_grad():
            assert torch.allclose(deployed.eval()(x), trained.eval()(x), atol=1e-4, rtol=1e-4)
        assert not any(".share_" in k or ".gate_" in k for k in dstate)


def test_heterotune_merge_averages_within_types_and_aligns_share_updates_with_cmga():
    cfg, strategy = _strategy(f"method=heterotune {TINY_IMAGE} {HETERO}")
    state = strategy.method.initial_state(0)
    g = torch.Generator().manual_seed(3)
    replies = []
    for node, i in enumerate((0, 0, 1)):
        spec, payload, _ = strategy.method.level_payload(i, state)
        keys = strategy.method.reply_keys(i, spec, payload)
        replies.append(
            Reply(
                node,
                i,
                strategy.levels[i],
                {k: payload[k] + torch.randn(payload[k].shape, generator=g) for k in keys},
                10 * (node + 1),
                np.ones(10, int),
                {},
            )
        )
    new = strategy.method.merge(1, state, replies)
    # local adapters: sample-weighted mean within type 0 (nodes 0 and 1: weights 1/3, 2/3)
    key = "adapters.0.down.weight"
    want = (replies[0].state[key] + 2 * replies[1].state[key]) / 3
    assert torch.allclose(new["type0." + key], want, atol=1e-6)
    assert torch.equal(new["type1." + key], replies[2].state[key])
    # share-adapters of slot 0: the two types' updates, aligned: orthogonal, equal length, norm kept
    deltas, aligned = [], []
    for i in (0, 1):
        keys = [f"adapters.0.share_{s}.{i}" for s in ("pre", "post")]
        if i == 0:
            mean = [(replies[0].state[k].double() + 2 * replies[1].state[k].double()) / 3 for k in keys]
        else:
            mean = [replies[2].state[k].double() for k in keys]
        deltas.append(torch.cat([(m - state[k].double()).flatten() for m, k in zip(mean, keys)]))
        aligned.append(torch.cat([(new[k].double() - state[k].double()).flatten() for k in keys]))
    G, Gt = torch.stack(deltas, 1), torch.stack(aligned, 1)
    c = default_scale(G)
    assert torch.allclose(Gt.T @ Gt, c**2 * torch.eye(2, dtype=torch.float64), rtol=1e-4, atol=1e-4 * c**2)
    assert float(torch.linalg.norm(Gt)) == pytest.approx(float(torch.linalg.norm(G)), rel=1e-4)
    # without CMGA: S_i <- S_i + Δ_i
    cfg, plain = _strategy(f"method=heterotune method.cmga=false {TINY_IMAGE} {HETERO}")
    new2 = plain.method.merge(1, state, replies)
    k = "adapters.0.share_pre.1"
    assert torch.allclose(new2[k], replies[2].state[k], atol=1e-6)


def test_heterotune_types_by_depth_share_slots_only_where_they_exist():
    cfg, strategy = _strategy(f"method=heterotune {TINY_TEXT} {HETERO}")
    assert strategy.method.depths == [2, 1] and strategy.method.members == [[0, 1], [0]]
    state = strategy.method.initial_state(0)
    _, small, _ = strategy.method.level_payload(1, state)
    assert {k for k in small if ".share_" in k} == {
        f"adapters.0.share_{s}.{j}" for s in ("pre", "post") for j in (0, 1)
    }
    costs = [strategy.method.level_cost(i) for i in range(2)]
    assert costs[0]["params"] > costs[1]["params"] and costs[1]["bytes_down"] > costs[1]["bytes_up"]
    cfg, vit = _strategy(f"method=heterotune {TINY_IMAGE} {HETERO}")  # ViT: types by width (auto)
    assert vit.method.depths == [2, 2] and [s["width"] for s in vit.method.type_specs] == [16, 8]
    cfg, vit = _strategy(f"method=heterotune {TINY_IMAGE} {HETERO} method.scale=depth")
    assert vit.method.depths == [2, 1] and [s["width"] for s in vit.method.type_specs] == [16, 16]


# ------------------------------------------------------------------------------------ whole runs


@pytest.mark.parametrize("method", ["fedlora", "heterotune"])
def test_in_process_round_of_each_method_is_valid_and_moves_only_adapters(method, tmp_path):
    extra = HETERO if method == "heterotune" else "method.max_rank=4"
    cfg = load_config(f"method={method} {TINY_TEXT} {extra}")
    summary = run(LocalGrid(4, client_handlers()), cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 4 and rows[-1]["rejected"] == 0 and rows[-1]["failures"] == 0
    costs = summary["level_costs"]
    assert all(0 < c["bytes_up"] < 1e6 for c in costs.values())  # no frozen backbone (~4 MB here) travels
    for level in cfg.levels.ratios:
        assert 0 <= summary[f"final_acc/level_{level:g}"] <= 1


def test_config_refuses_a_transformer_method_on_a_cnn_naming_the_field():
    assert load_config("method=fedlora").model.arch == "minilm"  # the method's own default track
    with pytest.raises(ConfigError, match="model.arch"):
        load_config("method=fedlora model=cnn dataset=fashion_mnist")
    with pytest.raises(ConfigError, match="dataset.name"):
        load_config("method=fedlora model=minilm dataset=fashion_mnist")
    with pytest.raises(ConfigError, match="method.scale"):
        load_config("method=heterotune model=minilm dataset=sentiment method.scale=width")


def test_inspect_prints_exact_trainable_parameters_and_bytes(capsys):
    from fedhm_flwr.ops.inspect import main

    assert main(["method=fedlora", *TINY_IMAGE.split(), "method.max_rank=4"]) == 0
    out = capsys.readouterr().out
    assert "adapter_params" in out and "head_params" in out and "bytes_up" in out
    cfg, strategy = _strategy(f"method=fedlora {TINY_IMAGE} method.max_rank=4")
    cost = strategy.method.level_cost(0)
    # rank 4 on Q, K, V, O of 2 blocks of width 16: 8 layers x 4 x (16 + 16); head 16 x 10 + 10
    assert cost["adapter_params"] == 8 * 4 * 32 and cost["head_params"] == 170
    assert lora_rank(0.125, 4) == 1


# ------------------------------------------------------------------------------------ flwr run


@pytest.mark.slow
def test_flwr_run_finishes_for_both_methods_on_both_tracks(tmp_path):
    """FedLoRA on the text track and HeteroTune on the image track (both methods, both tracks), each a
    2-round launch through `flwr run`. The two launches run side by side (each has its own SuperLink
    on free ports and its own Ray instance): a launch is mostly Flower's start-up, waiting (~20 s each
    here), so together they take little more than one."""
    jobs = {("fedlora", "text"): (TINY_TEXT, "method.max_rank=4"), ("heterotune", "image"): (TINY_IMAGE, HETERO)}
    procs = {}
    for (method, track), (base, extra) in jobs.items():
        out = tmp_path / f"{method}-{track}"
        cmd = [
            sys.executable,
            "-m",
            "fedhm_flwr.ops.launch",
            f"method={method}",
            *base.split(),
            *extra.split(),
            "rounds=2",
            "--run-dir",
            str(out),
        ]
        console = tmp_path / f"{method}-{track}.console"
        with console.open("wb") as sink:  # a file, not a pipe: neither launch waits for its output to be read
            procs[method, track] = (out, console, subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT))
    try:
        for (method, track), (out, console, proc) in procs.items():
            proc.wait(timeout=900)
            assert proc.returncode == 0, (method, track, console.read_text(errors="replace")[-6000:])
            summary = json.loads((out / "summary.json").read_text())
            assert summary["rounds_completed"] == 2 and math.isfinite(summary["final_acc/global"]), (method, track)
    finally:
        for _, _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
