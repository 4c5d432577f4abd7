"""A node's data apart from shards: the held-out split of its partition (a node without one
answers evaluate with an error) and the data check before start. Shards are in tests/test_shards.py.

All on the real Fashion-MNIST files (Debian package); no network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from data_helpers import REPO, needs_fmnist, train_messages
from flwr.app import Message, MessageType, RecordDict

from fedhm_flwr import data as D
from fedhm_flwr.config import ConfigError, load_config
from fedhm_flwr.data.files import check_data_available
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers

pytestmark = pytest.mark.usefixtures("no_env_data_dir")  # tests/conftest.py


# --------------------------------------------------------------------------- held-out split


@pytest.mark.parametrize("n,fraction", [(1, 0.5), (7, 0.3), (100, 0.1), (5, 0.99), (1000, 0.25), (10, 0.0)])
def test_holdout_split_is_a_seeded_disjoint_cover_of_the_partition(n, fraction):
    train, heldout = D.holdout_split(n, fraction, seed=3, partition_id=2)
    assert np.intersect1d(train, heldout).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, heldout])), np.arange(n))
    assert len(heldout) == min(round(fraction * n), n - 1) and len(train) >= 1
    assert list(train) == sorted(train) and list(heldout) == sorted(heldout)
    again = D.holdout_split(n, fraction, seed=3, partition_id=2)
    np.testing.assert_array_equal(again[1], heldout)


def test_holdout_split_depends_on_seed_and_partition():
    draws = {tuple(D.holdout_split(200, 0.2, s, p)[1]) for s in (0, 1) for p in (0, 1)}
    assert len(draws) == 4


@needs_fmnist
def test_holdout_zero_trains_on_exactly_todays_partition_and_a_fraction_is_split_off():
    spec = D.make_data_spec("fashion_mnist", 4, max_train_examples=2000, scheme="dirichlet", alpha=0.5)
    for pid, part in enumerate(D.partition_indices(spec)):
        np.testing.assert_array_equal(D.client_indices(spec, pid, split="train"), part)
        assert D.client_indices(spec, pid, split="heldout").size == 0
        cut = {**spec, "holdout": 0.25}
        train, held = D.client_indices(cut, pid, split="train"), D.client_indices(cut, pid, split="heldout")
        assert np.intersect1d(train, held).size == 0 and len(held) == round(0.25 * len(part))
        np.testing.assert_array_equal(np.sort(np.concatenate([train, held])), part)
    images, labels = D.load_arrays("fashion_mnist", "train")
    ds = D.client_dataset(spec, 1)  # today's examples: the partition's rows, in order, normalised
    part = D.partition_indices(spec)[1]
    expected = (torch.from_numpy(images[part].transpose(0, 3, 1, 2).astype(np.float32)) / 255 - 0.2860) / 0.3530
    assert torch.allclose(ds.images, expected, atol=1e-6)
    np.testing.assert_array_equal(ds.label_array(), labels[part])
    with pytest.raises(ValueError, match=r"split.*allowed values.*heldout"):
        D.client_dataset(spec, 0, split="test")


def _as_evaluate(msg: Message) -> Message:
    return Message(
        RecordDict({"arrays": msg.content["arrays"], "config": msg.content["config"]}),
        dst_node_id=msg.metadata.dst_node_id,
        message_type=MessageType.EVALUATE,
    )


@needs_fmnist
def test_a_node_without_held_out_examples_answers_evaluate_with_an_error(toy_cfg):
    cfg = toy_cfg()  # evaluation.where=server: nodes hold nothing out
    grid = LocalGrid(6, client_handlers())
    replies = grid.send_and_receive([_as_evaluate(m) for m in train_messages(cfg, grid)[:2]])
    assert replies and all(r.has_error() and "no held-out examples" in r.error.reason for r in replies)
    assert all("evaluation.holdout" in r.error.reason for r in replies)


# --------------------------------------------------------------------------- data check before start

CHECK_SCRIPT = textwrap.dedent("""
    import time
    t0 = time.perf_counter()
    import sys
    from fedhm_flwr.config import ConfigError, compose_config, load_config
    from fedhm_flwr.data.files import check_data_available

    def check(cfg):
        try:
            check_data_available(cfg)
            return "ok"
        except ConfigError as exc:
            return str(exc)

    message = check(compose_config(sys.argv[1:]))  # imports, composition and the check: no torch
    seconds, torch_loaded = time.perf_counter() - t0, "torch" in sys.modules
    again = check(load_config(sys.argv[1:]))  # on the validated config (validation imports the models)
    print(torch_loaded, seconds, again == message)
    print(message)
""")


def test_cifar_without_its_data_fails_the_check_in_one_line_quickly_without_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}  # no ~/.cache download root
    env.pop(D.DATA_DIR_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_SCRIPT, "dataset=cifar10", f"dataset.data_dir={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    timing, message = proc.stdout.strip().split("\n")
    torch_loaded, seconds, same = timing.split()
    assert float(seconds) < 5 and torch_loaded == "False" and same == "True", timing
    assert message.startswith("invalid config: dataset.data_dir=")
    assert "FEDHM_DATA_DIR" in message and "dataset.download=true" in message and "cifar-10-batches-py" in message


def test_data_check_covers_the_server_and_the_simulated_clients(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cifar-10-batches-py").mkdir()
    server_only = load_config(["dataset=cifar10", f"dataset.data_dir={tmp_path}"])
    check_data_available(server_only, simulation=False)  # the server's copy is there
    with pytest.raises(ConfigError, match=r"FEDHM_DATA_DIR.*simulated clients' training data") as err:
        check_data_available(server_only, simulation=True)  # simulated clients do not read data_dir
    assert err.value.field == "FEDHM_DATA_DIR"
    monkeypatch.setenv(D.DATA_DIR_ENV, str(tmp_path))
    check_data_available(server_only, simulation=True)
    # clients evaluate: a deployment's server needs no data; CIFAR with download is allowed to fetch
    nothing = load_config(["dataset=cifar10", f"dataset.data_dir={tmp_path / 'x'}", "evaluation.where=clients"])
    check_data_available(nothing, simulation=False)
    with pytest.raises(ConfigError):
        check_data_available(load_config(["dataset=cifar100", f"dataset.data_dir={tmp_path}"]), simulation=False)
    check_data_available(load_config(["dataset=cifar100", "dataset.download=true"]), simulation=True)


@needs_fmnist
def test_data_check_finds_fashion_mnist_and_refuses_an_empty_folder(tmp_path, monkeypatch):
    check_data_available(load_config([]), simulation=True)  # the system copy
    with pytest.raises(ConfigError, match=r"dataset\.data_dir=.*Fashion-MNIST test files.*apt-get install") as err:
        check_data_available(load_config([f"dataset.data_dir={tmp_path}"]), simulation=False)
    assert err.value.field == "dataset.data_dir" and "\n" not in str(err.value)
    monkeypatch.setenv(D.DATA_DIR_ENV, str(tmp_path))  # an empty $FEDHM_DATA_DIR: the system copy, as loading does
    check_data_available(load_config([]), simulation=True)
