"""What a run's config says to the rest of the code, as plain data: the global model's spec, the data
spec every message carries, the levels' shares, the round's learning rate.

Torch-free except for a ViT's spec (see :func:`model_spec`), so the launcher can derive specs before
importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.data.sources import dataset_info
from fedhm_flwr.data.spec import SOURCE_DEFAULTS


def backbone_choice(cfg: DictConfig) -> str:
    """``model.backbone`` as used: ``auto`` is ``pretrained`` for the fine-tuning methods (FedLoRA,
    HeteroTune) and ``random`` for the methods that train the whole model from scratch (FedHM,
    FedAvg), as the FedHM papers train theirs."""
    value = str(cfg.model.get("backbone", "pretrained"))
    if value == "auto":
        return "random" if cfg.method.name in ("fedhm", "fedavg") else "pretrained"
    return value


def level_proportions(cfg: DictConfig) -> list[float]:
    """The levels' shares of clients (``levels.proportions``; null = equal shares)."""
    props = cfg.levels.proportions
    return [1.0] * len(cfg.levels.ratios) if props is None else [float(p) for p in props]


def model_spec(cfg: DictConfig) -> dict[str, Any]:
    """The full (global) model's spec: what ``models.build_model`` needs, as plain JSON types."""
    info = dataset_info(cfg.dataset.name, data_spec(cfg))  # a folder source's classes are read from dataset.path
    spec = {"arch": cfg.model.arch, **{k: int(v) for k, v in info.items()}}  # image: classes, channels, size
    if cfg.model.get("width") is not None:
        spec["width"] = int(cfg.model.width)
    if cfg.model.arch == "custom":
        spec["target"] = str(cfg.model.target)
        spec["kwargs"] = OmegaConf.to_container(cfg.model.kwargs, resolve=True) if cfg.model.get("kwargs") else {}
    rule = cfg.model.get("factorize")
    # (a mapping: the config check admits only one; omegaconf types any container's conversion)
    rule = (
        {k: v for k, v in cast("dict[str, Any]", OmegaConf.to_container(rule, resolve=True)).items() if v is not None}
        if rule
        else {}
    )
    if rule:
        spec["factorize"] = rule
    if cfg.model.arch == "custom" and cfg.model.get("static_bn", False):  # built-in models are always sBN
        spec["static_bn"] = True
    if cfg.model.arch == "vit" and cfg.method.name in ("fedhm", "fedavg"):  # the whole ViT trains (FedHM)
        from fedhm_flwr.models.vit import DEFAULTS, arch_of, checkpoint_ref  # torch: only a ViT's spec needs it

        for key in DEFAULTS:
            spec[key] = int(cfg.model.get(key) or DEFAULTS[key])
        spec["backbone_seed"] = int(cfg.model.get("backbone_seed", 0) or 0)
        pretrained = backbone_choice(cfg) == "pretrained"
        spec["backbone"] = checkpoint_ref(arch_of(spec)) if pretrained else "random"
        spec["train_backbone"] = True
    return spec


def data_spec(cfg: DictConfig, num_partitions: int | None = None) -> dict[str, Any]:
    """What a client needs to find its partition (its data location comes from its node)."""
    return {
        "name": cfg.dataset.name,
        "scheme": cfg.partition.scheme,
        "num_partitions": int(num_partitions if num_partitions is not None else cfg.num_clients),
        "alpha": float(cfg.partition.alpha),
        "classes_per_partition": int(cfg.partition.classes_per_partition),
        "seed": int(cfg.seed),
        "max_train_examples": int(cfg.dataset.max_train_examples),
        "max_test_examples": int(cfg.dataset.max_test_examples),
        "augment": bool(cfg.dataset.augment),
        "download": bool(cfg.dataset.download),
        "holdout": holdout_fraction(cfg),
        **source_options(cfg),
    }


def source_options(cfg: DictConfig) -> dict[str, Any]:
    """A folder source's options (``dataset.path``, ``dataset.image_size``, ...; none for the others)."""
    return {key: cfg.dataset.get(key, default) for key, default in SOURCE_DEFAULTS.get(cfg.dataset.name, {}).items()}


def holdout_fraction(cfg: DictConfig) -> float:
    """The fraction of each node's examples held out for client-side evaluation: the configured
    ``evaluation.holdout`` when clients evaluate, else 0 (nodes train on all their examples)."""
    return float(cfg.evaluation.holdout) if cfg.evaluation.where in ("clients", "both") else 0.0


def lr_schedule(cfg: DictConfig) -> Callable[[int], float]:
    """The configured schedule as a function of the round (rounds start at 1), the config read once
    (a server round asks every round: the lookups cost more than the formula)."""
    t = cfg.train
    return schedule(float(t.lr), int(cfg.rounds), str(t.lr_schedule), tuple(t.lr_step_rounds), float(t.lr_gamma))


def schedule(
    base: float, total: int, kind: str, step_rounds: tuple[float, ...], gamma: float
) -> Callable[[int], float]:
    """``train.lr_schedule`` as a function of the round (rounds start at 1): constant, cosine over
    ``total`` rounds, or ``step`` (× ``gamma`` past each fraction of ``step_rounds``)."""
    if kind == "cosine":
        return lambda server_round: 0.5 * base * (1 + math.cos(math.pi * (server_round - 1) / max(1, total)))
    if kind == "step":
        cuts = [f * total for f in step_rounds]
        return lambda server_round: base * gamma ** sum(server_round > cut for cut in cuts)
    return lambda server_round: base


def learning_rate(cfg: DictConfig, server_round: int) -> float:
    """The round's learning rate under the configured schedule (rounds start at 1)."""
    return lr_schedule(cfg)(server_round)
