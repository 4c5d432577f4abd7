"""The options of the methods that fine-tune a transformer: FedLoRA and HeteroTune
(docs/METHODS.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import choice, flags, int_at_least, is_int, is_num, num_in, require
from fedhm_flwr.config.options.base import MethodOptions, check_tau, supported_pairs


@dataclass(frozen=True)
class TransformerOptions(MethodOptions):
    """FedLoRA / HeteroTune: a transformer over a frozen pre-trained (or seeded random) backbone,
    trained by the client's own optimizer."""

    models = ("minilm", "vit")

    optimizer: str
    lr: float | None

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        arch = OmegaConf.select(cfg, "model.arch")
        require(
            arch in ("minilm", "vit"),
            "model.arch",
            arch,
            f"one of ['minilm', 'vit'] (method={cls.name} fine-tunes a transformer: add "
            "model=minilm dataset=sentiment, or model=vit dataset=fashion_mnist). "
            f"Supported pairs: {supported_pairs()}",
        )
        choice(cfg, "model.backbone", ("auto", "pretrained", "random"))
        int_at_least(cfg, "model.backbone_seed", 0)
        for field in ("model.depth", "model.heads"):
            value = OmegaConf.select(cfg, field)
            require(
                value is None or (is_int(value) and value >= 1),
                field,
                value,
                "null (the architecture's default) or an integer >= 1",
            )
        text = cfg.model.arch == "minilm"
        require(
            text == (cfg.dataset.name == "sentiment"),
            "dataset.name",
            cfg.dataset.name,
            f"'sentiment' with model=minilm, an image dataset with model=vit (method={cls.name})",
        )
        choice(cfg, "method.optimizer", ("adamw", "sgd"))
        lr = OmegaConf.select(cfg, "method.lr")
        require(lr is None or (is_num(lr) and 0 < lr < math.inf), "method.lr", lr, "null (train.lr) or a number > 0")


@dataclass(frozen=True)
class FedLoRAOptions(TransformerOptions):
    """FedLoRA: LoRA ranks per level (or full fine-tuning), FedHM's softmax(gamma/tau) weights."""

    name = "fedlora"
    needs = "a transformer with LoRA targets (minilm, vit)"

    mode: str
    max_rank: int
    tau: float
    weight_by_samples: bool

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        super().check(cfg)
        choice(cfg, "method.mode", ("lora", "full"))
        int_at_least(cfg, "method.max_rank", 1)
        check_tau(cfg)
        flags(cfg, "method.weight_by_samples")


@dataclass(frozen=True)
class HeteroTuneOptions(TransformerOptions):
    """HeteroTune: model types by depth or width, DeMA bottleneck, bank and CMGA switches."""

    name = "heterotune"
    needs = "a transformer with DeMA slots (minilm, vit)"

    scale: str
    bottleneck: int
    bank: bool
    cmga: bool
    cmga_eps: float
    cmga_scale: float | None

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        super().check(cfg)
        choice(cfg, "method.scale", ("auto", "depth", "width"))
        if cfg.model.arch == "minilm":
            choice(cfg, "method.scale", ("auto", "depth"))  # the packaged MiniLM has one width
        int_at_least(cfg, "method.bottleneck", 1)
        flags(cfg, "method.bank", "method.cmga")
        num_in(cfg, "method.cmga_eps", 0.0, math.inf, high_open=True)
        scale = OmegaConf.select(cfg, "method.cmga_scale")
        require(
            scale is None or (is_num(scale) and scale > 0),
            "method.cmga_scale",
            scale,
            "null (c = ||G||_F / sqrt(N)) or a number > 0",
        )
