"""Transformer track, models and data: packaged MiniLM, sentiment data, ViT backbones, what trains at
each client type, config refusals and ``inspect``. Rounds of FedLoRA and HeteroTune are in
tests/test_transformer_track_rounds.py.

Fast tests use tiny seeded random backbones; only the reference test loads the packaged MiniLM.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformer_helpers import HETERO, TINY_IMAGE, TINY_TEXT, build_strategy

from fedhm_flwr.config import ConfigError, load_config
from fedhm_flwr.data import client_dataset, make_data_spec, test_dataset
from fedhm_flwr.data.text import load_corpus, partition_indices, split_indices
from fedhm_flwr.math.lora import lora_rank
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import federated_keys, load_federated, trainable_state

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
    strategy = build_strategy(f"method=fedlora {base} method.max_rank=4")
    state = strategy.method.initial_state(0)
    for i in range(len(strategy.levels)):
        spec, payload, _ = strategy.method.level_payload(i, state)
        model, grads = _grads_after_backward(spec, payload, x)
        assert grads == set(payload) == set(trainable_state(model))
        assert all(k.endswith(("lora_A", "lora_B")) or k.startswith("head.") for k in grads)
        assert len([k for k in grads if k.endswith("lora_A")]) == len(model.lora_targets())
        assert payload[next(k for k in payload if k.endswith("lora_A"))].shape[0] == strategy.method.ranks[i]
    # full fine-tuning: everything
    strategy = build_strategy(f"method=fedlora method.mode=full {base} levels.ratios=[1] levels.proportions=[1]")
    spec, payload, _ = strategy.method.level_payload(0, strategy.method.initial_state(0))
    model, grads = _grads_after_backward(spec, payload, x)
    assert grads == {k for k, _ in model.named_parameters()}
    # HeteroTune: local adapters, gates, own share-adapters, head; other types' shares frozen
    strategy = build_strategy(f"method=heterotune {base} {HETERO}")
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
    strategy = build_strategy(f"method=heterotune method.bank=false {base} {HETERO}")
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


# ------------------------------------------------------------------------------------ config and inspect


def test_config_refuses_a_transformer_method_on_a_cnn_naming_the_field():
    assert load_config("method=fedlora").model.arch == "minilm"  # the method's own default track
    with pytest.raises(ConfigError, match=r"model\.arch"):
        load_config("method=fedlora model=cnn dataset=fashion_mnist")
    with pytest.raises(ConfigError, match=r"dataset\.name"):
        load_config("method=fedlora model=minilm dataset=fashion_mnist")
    with pytest.raises(ConfigError, match=r"method\.scale"):
        load_config("method=heterotune model=minilm dataset=sentiment method.scale=width")


def test_inspect_prints_exact_trainable_parameters_and_bytes(capsys):
    from fedhm_flwr.ops.tools.cost_table import main

    assert main(["method=fedlora", *TINY_IMAGE.split(), "method.max_rank=4"]) == 0
    out = capsys.readouterr().out
    assert "adapter_params" in out and "head_params" in out and "bytes_up" in out
    strategy = build_strategy(f"method=fedlora {TINY_IMAGE} method.max_rank=4")
    cost = strategy.method.level_cost(0)
    # rank 4 on Q, K, V, O of 2 blocks of width 16: 8 layers x 4 x (16 + 16); head 16 x 10 + 10
    assert cost["adapter_params"] == 8 * 4 * 32 and cost["head_params"] == 170
    assert lora_rank(0.125, 4) == 1
