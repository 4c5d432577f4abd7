"""What the data tests share (tests/test_shards.py, tests/test_node_data.py): the repository root,
the mark for tests that need the installed Fashion-MNIST, and one round's training messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import ArrayRecord

from fedhm_flwr import data as D
from fedhm_flwr.config import run_options
from fedhm_flwr.data.files import fashion_files

REPO = Path(__file__).resolve().parent.parent
needs_fmnist = pytest.mark.skipif(
    any(fashion_files(split, D.FASHION_MNIST_SYSTEM_DIR) is None for split in ("train", "test")),
    reason="Fashion-MNIST IDX files not installed (apt-get install dataset-fashion-mnist)",
)


def train_messages(cfg, grid):
    from fedhm_flwr.config import model_spec
    from fedhm_flwr.ops.server_app import initial_state
    from fedhm_flwr.server.registry import FedHMStrategy

    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    state = ArrayRecord.from_torch_state_dict(initial_state(cfg, strategy.method.spec))
    return list(strategy.configure_train(1, state, None, grid))
