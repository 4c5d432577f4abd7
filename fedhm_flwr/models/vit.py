"""Small Vision Transformers for 28×28 images, over a backbone pre-trained by ``make pretrain``.

Pre-LN ViT: a ``patch``×``patch`` conv patch embedding, a class token, learnt positions,
``depth`` blocks (``x + attn(norm1(x))``, ``x + mlp(norm2(x))``, GELU MLP of ``mlp_ratio ·
width``), a final LayerNorm and a linear ``head`` on the class token. Attention has separate
``query``/``key``/``value`` projections and an output projection ``out`` (the LoRA targets).

Three sizes differ in width only (same depth, heads, patch): by default 64, 32 and 16, i.e. the
widths of level ratios 1, 1/2 and 1/4 of ``model.width`` (small enough to pre-train on a CPU in
minutes). No ViT weights ship anywhere offline:
``python -m fedhm_flwr.ops.tools.pretrain`` (``make pretrain``) trains the backbones and writes them to
``$FEDHM_CACHE/vit/`` (default ``~/.cache/fedhm-flwr/vit/``), one safetensors file per size
named by :func:`checkpoint_name`; the file's metadata repeats the architecture and is checked on
load. Nothing is ever committed or sent: the model spec names the file (``backbone:
"cache:vit/<name>"``) and every node loads its own copy. ``backbone: "random"`` builds a seeded
random backbone instead (tests; the frozen-random ablation).

Spec keys (:func:`build_vit`): ``num_classes``, ``in_channels``, ``image_size``, ``width``
(64), ``depth`` (4), ``heads`` (2), ``patch`` (7), ``mlp_ratio`` (2), ``backbone``,
``backbone_seed`` (0), and the adaptation keys of :mod:`fedhm_flwr.models.transformer`. A spec may
keep fewer blocks than its checkpoint (``depth`` below the file's): the leading blocks are loaded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from .rules import FactorizeRule, select_layers

CACHE_ENV = "FEDHM_CACHE"
DEFAULTS = {"width": 64, "depth": 4, "heads": 2, "patch": 7, "mlp_ratio": 2}
ARCH_KEYS = ("width", "depth", "heads", "patch", "mlp_ratio", "in_channels", "image_size")

_LOCK = threading.Lock()
_CHECKPOINTS: dict[tuple[str, float], tuple[dict[str, Tensor], dict[str, str]]] = {}


def cache_dir() -> Path:
    """``$FEDHM_CACHE`` or ``~/.cache/fedhm-flwr``: where pre-trained backbones live (never in the repo)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fedhm-flwr").expanduser()


def arch_of(spec: Mapping[str, Any]) -> dict[str, int]:
    """The architecture numbers of a spec (defaults filled in)."""
    out = {k: int(spec.get(k) or DEFAULTS[k]) for k in DEFAULTS}
    out["in_channels"], out["image_size"] = int(spec["in_channels"]), int(spec["image_size"])
    return out


def checkpoint_name(arch: Mapping[str, int]) -> str:
    """File name of a pre-trained backbone, e.g. ``vit-w128-d4-h4-p7-m2-c1-s28.safetensors``."""
    a = {k: int(arch[k]) for k in ARCH_KEYS}
    return (
        f"vit-w{a['width']}-d{a['depth']}-h{a['heads']}-p{a['patch']}-m{a['mlp_ratio']}"
        f"-c{a['in_channels']}-s{a['image_size']}.safetensors"
    )


def checkpoint_ref(arch: Mapping[str, int]) -> str:
    """The spec's backbone reference of a pre-trained size: ``cache:vit/<name>``."""
    return f"cache:vit/{checkpoint_name(arch)}"


def resolve_ref(ref: str) -> Path:
    """The local file a ``cache:<relative path>`` reference names on this node."""
    if not ref.startswith("cache:"):
        raise ValueError(f"not a cache reference: {ref!r}")
    rel = Path(ref[len("cache:") :])
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"cache reference must be a relative path inside the cache: {ref!r}")
    return cache_dir() / rel


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Pre-LN ViT classifier; ``adapters`` (one per block) are added to each block's output.

    FedHM (:mod:`fedhm_flwr.models.rules`): the Linear layers of every block's attention
    (``query``, ``key``, ``value``, ``out``) and MLP (``mlp.0``, ``mlp.2``) are factorizable, six
    per block in forward order; the patch embedding and the head stay full. ``default_rho = 6``
    keeps the first block full rank (ρ counts layers: ``method.rho = 6·b`` keeps ``b`` blocks).
    """

    local_keys: list[str]  # the backbone's state keys (set by vit_backbone, transformer.adapt)

    classifier_name = "head"
    layers_per_block = 6
    default_rho = 6
    factorize_rule = FactorizeRule(include=("blocks.*.attn.*", "blocks.*.mlp.*"), types=("Linear",))

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        image_size: int,
        width: int,
        depth: int,
        heads: int,
        patch: int,
        mlp_ratio: int,
    ) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch}")
        self.width, self.depth = width, depth
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.adapters: nn.ModuleList | None = None
        self.head = nn.Linear(width, num_classes)

    @property
    def block_dim(self) -> int:
        return self.width

    def factorizable_layers(self) -> list[str]:
        """Attention and MLP Linear layers of every block, in forward order (the rule's selection)."""
        return select_layers(self)

    def lora_targets(self) -> list[str]:
        """Q, K, V and the attention output projection of every block."""
        return [f"blocks.{i}.attn.{p}" for i in range(self.depth) for p in ("query", "key", "value", "out")]

    def features(self, x: Tensor) -> Tensor:
        """The final class-token state ``(batch, width)``."""
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.adapters is not None:
                x = x + self.adapters[i](x)
        return self.norm(x[:, 0])

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _vit_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def new_vit(spec: Mapping[str, Any], seed: int | None = None) -> ViT:
    """A randomly initialised ViT of the spec's size (seeded without touching the global RNG)."""
    a = arch_of(spec)
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(int(seed))
        model = ViT(
            int(spec["num_classes"]),
            a["in_channels"],
            a["image_size"],
            a["width"],
            a["depth"],
            a["heads"],
            a["patch"],
            a["mlp_ratio"],
        )
        model.apply(_vit_init)
    return model


def backbone_keys(model: nn.Module) -> list[str]:
    """Every state key but the head's."""
    return [k for k in model.state_dict() if not k.startswith("head.")]


def load_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A pre-trained backbone file: (tensors, metadata); cached per process."""
    if not path.is_file():
        raise FileNotFoundError(
            f"pre-trained ViT backbone {path} not found: run `make pretrain` (python -m fedhm_flwr.ops.tools.pretrain) "
            f"on this node first (cache folder: ${CACHE_ENV} or ~/.cache/fedhm-flwr), or use model.backbone=random"
        )
    key = (str(path), path.stat().st_mtime)
    with _LOCK:
        if key not in _CHECKPOINTS:
            with safe_open(str(path), "pt") as f:
                meta = dict(f.metadata() or {})
            _CHECKPOINTS[key] = (load_file(str(path)), meta)
        return _CHECKPOINTS[key]


def vit_backbone(spec: Mapping[str, Any]) -> ViT:
    """The ViT classifier over the spec's backbone (cache checkpoint or seeded random); nothing frozen.

    ``model.local_keys`` lists the backbone's state keys (everything but the head).
    """
    backbone = str(spec.get("backbone", "random"))
    if backbone == "random":
        model = new_vit(spec, seed=int(spec.get("backbone_seed", 0)))
    elif backbone.startswith("cache:"):
        model = new_vit(spec)
        path = resolve_ref(backbone)
        tensors, meta = load_checkpoint(path)
        arch = arch_of(spec)
        stored = {k: int(meta[k]) for k in ARCH_KEYS if k in meta}
        same = all(stored.get(k) == arch[k] for k in ARCH_KEYS if k != "depth")
        if not same or len(stored) != len(ARCH_KEYS) or stored["depth"] < arch["depth"]:
            raise ValueError(
                f"{path}: checkpoint architecture {stored} does not match the spec's {arch} "
                "(only the depth may be smaller: the leading blocks are kept)"
            )
        keys = backbone_keys(model)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ValueError(f"{path} lacks {missing[:3]}")
        model.load_state_dict({k: tensors[k] for k in keys}, strict=False)
    else:
        raise ValueError(f"model spec: backbone {backbone!r} is unknown; allowed: 'cache:vit/<file>', 'random'")
    model.local_keys = backbone_keys(model)
    return model
