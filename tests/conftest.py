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


@pytest.fixture
def no_env_data_dir(monkeypatch):
    """No ``$FEDHM_DATA_DIR`` from the caller's shell: the data tests see only the folders they name
    (tests/test_shards.py and tests/test_node_data.py use it for every test)."""
    from fedhm_flwr.data import DATA_DIR_ENV

    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
