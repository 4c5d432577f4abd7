"""What the data tests share (tests/test_shards.py, tests/test_node_data.py, tests/test_data.py,
tests/test_results_full.py): the repository root, the mark for tests that need the installed
Fashion-MNIST, one round's training messages and a small fake CIFAR-10 folder."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
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
    from fedhm_flwr.ops.apps.server_app import initial_state
    from fedhm_flwr.server.registry import FedHMStrategy

    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    state = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
    return list(strategy.configure_train(1, state, None, grid))


def fake_cifar10(root: Path, n_per_batch: int = 20, n_test: int | None = None) -> Path:
    """``root/cifar-10-batches-py`` in torchvision's pickle layout (data_batch_1..5, test_batch,
    batches.meta), ``n_per_batch`` random images per file (``n_test`` in test_batch: default
    ``n_per_batch``) with labels cycling over the 10 classes."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, fname in enumerate(names):
        n = n_test if fname == "test_batch" and n_test is not None else n_per_batch
        entry = {
            "data": rng.integers(0, 256, size=(n, 3 * 32 * 32), dtype=np.uint8),
            "labels": [int(v) for v in (np.arange(n) + k) % 10],
        }
        with open(folder / fname, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    return folder
