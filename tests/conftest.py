"""Shared fixtures: small configurations and the in-process grid."""

from __future__ import annotations

import pytest

from fedhm_flwr.config import load_config

TOY = ("num_clients=6 fraction_train=1.0 dataset.max_train_examples=1200 dataset.max_test_examples=300 "
       "model.width=4 train.batch_size=64 evaluation.batch_size=300")


@pytest.fixture
def toy_cfg():
    """A seconds-long FedHM configuration (tiny CNN, 1.2k training images, 6 clients)."""
    def make(extra: str = ""):
        return load_config(f"{TOY} {extra}")
    return make
