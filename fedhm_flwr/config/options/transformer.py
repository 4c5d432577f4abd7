"""The options of the methods that fine-tune a transformer: FedLoRA and HeteroTune
(docs/METHODS.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic.dataclasses import dataclass

from fedhm_flwr.config.options.base import MethodOptions, Tau, supported_pairs, tau, weight_by_samples
from fedhm_flwr.config.options.declare import DECLARED, Flag, Int, Num, OneOf, Text, option
from fedhm_flwr.config.options.sections import ROBUST
from fedhm_flwr.core.errors import ConfigError


@dataclass(frozen=True, config=DECLARED)
class TransformerOptions(MethodOptions):
    """FedLoRA / HeteroTune: a transformer over a frozen pre-trained (or seeded random) backbone,
    trained by the client's own optimizer."""

    models = ("minilm", "vit")

    optimizer: Annotated[Text, OneOf(("adamw", "sgd"))] = option(
        "adamw", "client optimizer: adamw (LoRA / adapter practice) | sgd (train.momentum)"
    )
    lr: Num | None = option(
        1.0e-3,
        "client learning rate under train.lr_schedule; null = train.lr",
        allowed="null (train.lr) or a number > 0",
        gt=0.0,
        lt=math.inf,
    )

    def across(self, config: Mapping[str, Any]) -> None:
        """A transformer and its dataset: ``model.arch`` and ``dataset.name``."""
        arch = (config.get("model") or {}).get("arch")
        if arch not in ("minilm", "vit"):
            raise ConfigError(
                "model.arch",
                arch,
                f"one of ['minilm', 'vit'] (method={self.name} fine-tunes a transformer: add "
                "model=minilm dataset=sentiment, or model=vit dataset=fashion_mnist). "
                f"Supported pairs: {supported_pairs()}",
            )
        dataset = (config.get("dataset") or {}).get("name")
        if (arch == "minilm") != (dataset == "sentiment"):
            raise ConfigError(
                "dataset.name",
                dataset,
                f"'sentiment' with model=minilm, an image dataset with model=vit (method={self.name})",
            )


@dataclass(frozen=True, config=DECLARED)
class FedLoRAOptions(TransformerOptions):
    """FedLoRA: LoRA ranks per level (or full fine-tuning), FedHM's softmax(gamma/tau) weights."""

    name = "fedlora"
    needs = "a transformer with LoRA targets (minilm, vit)"

    mode: Annotated[Text, OneOf(("lora", "full"))] = option(
        "lora", "lora | full (full fine-tuning baseline: every weight trained and sent)"
    )
    max_rank: Int = option(16, "the rank of level 1 (a level gamma trains rank max(1, round(gamma * max_rank)))", ge=1)
    tau: Tau = tau(1.0)
    weight_by_samples: Flag = weight_by_samples(False)

    def robust_modes(self) -> tuple[str, ...]:
        return ROBUST  # every client sends the whole adapter set


@dataclass(frozen=True, config=DECLARED)
class HeteroTuneOptions(TransformerOptions):
    """HeteroTune: model types by depth or width, DeMA bottleneck, bank and CMGA switches."""

    name = "heterotune"
    needs = "a transformer with DeMA slots (minilm, vit)"

    scale: Annotated[Text, OneOf(("auto", "depth", "width"))] = option(
        "auto", "how a level's ratio sizes its type: depth | width | auto (MiniLM depth, ViT width)"
    )
    bottleneck: Int = option(64, "adapter bottleneck h shared by all types", ge=1)
    bank: Flag = option(True, "DeMA share-adapter bank; false = plain adapters averaged within a type")
    cmga: Flag = option(True, "CMGA across types on the share-adapter updates")
    cmga_eps: Num = option(1.0e-8, "relative regulariser: eps * trace(G^T G) / N", ge=0.0, lt=math.inf)
    cmga_scale: Num | None = option(
        None,
        "c; null = ||G||_F / sqrt(N) (keeps the update size)",
        allowed="null (c = ||G||_F / sqrt(N)) or a number > 0",
        gt=0.0,
    )

    def across(self, config: Mapping[str, Any]) -> None:
        super().across(config)
        if config["model"]["arch"] == "minilm" and self.scale not in ("auto", "depth"):
            raise ConfigError("method.scale", self.scale, "one of ['auto', 'depth']")  # the packaged MiniLM: one width
