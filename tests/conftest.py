"""Shared fixtures: small configurations and the in-process grid."""

from __future__ import annotations

import signal

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


@pytest.fixture
def ctrl_c_reaches_children():
    """Processes the test starts take Ctrl-C (SIGINT) as a terminal's foreground job does, also where
    pytest itself ignores SIGINT (started with ``&`` from a script: children inherit the ignored
    signal). tests/test_deploy.py's Ctrl-C to ``flwr run`` is otherwise lost, and its log stream
    ends only when the SuperLink gives up on it, about a minute later."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets a handler to the default
    yield
    signal.signal(signal.SIGINT, previous)
