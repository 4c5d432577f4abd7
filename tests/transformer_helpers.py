"""Shared configurations of the transformer-track tests: tiny seeded random backbones on the text
(MiniLM, sentiment) and image (ViT, Fashion-MNIST) tracks, and a strategy built from overrides."""

from __future__ import annotations

from fedhm_flwr.config import load_config, model_spec, run_options
from fedhm_flwr.server.registry import STRATEGIES

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


def build_strategy(overrides: str):
    """The server strategy of the configuration ``overrides`` describe."""
    cfg = load_config(overrides)
    return STRATEGIES[cfg.method.name](run_options(cfg), model_spec(cfg))
