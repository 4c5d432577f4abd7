"""Per-node shards (export, load, node side), the held-out split, and the data check before start.

All on the real Fashion-MNIST files (Debian package); no network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedhm_flwr import data as D
from fedhm_flwr.client import handlers as base
from fedhm_flwr.config import ConfigError, data_spec, load_config
from fedhm_flwr.data import shards
from fedhm_flwr.data.files import check_data_available, fashion_files
from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.shards import main as export_main

REPO = Path(__file__).resolve().parent.parent
SMALL = ["num_clients=4", "dataset.max_train_examples=2000", "evaluation.where=both"]
needs_fmnist = pytest.mark.skipif(
    any(fashion_files(split, D.FASHION_MNIST_SYSTEM_DIR) is None for split in ("train", "test")),
    reason="Fashion-MNIST IDX files not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(D.DATA_DIR_ENV, raising=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The small run's shards, written through the command line's entry point."""
    out = tmp_path_factory.mktemp("shards") / "out"
    assert export_main([*SMALL, f"out={out}"]) == 0
    return D.check_data_spec(data_spec(load_config(SMALL))), out


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
    with pytest.raises(ValueError, match="split.*allowed values.*heldout"):
        D.client_dataset(spec, 0, split="test")


# --------------------------------------------------------------------------- shards = simulation


@needs_fmnist
def test_shards_hold_exactly_the_simulations_partitions(exported):
    spec, out = exported
    assert sorted(p.name for p in out.iterdir()) == [f"partition-{i}" for i in range(4)]
    for pid in range(4):
        folder = out / f"partition-{pid}"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert (manifest["dataset"], manifest["partition_id"], manifest["num_partitions"]) == ("fashion_mnist", pid, 4)
        assert manifest["holdout"] == 0.1 and manifest["seed"] == 0 and manifest["max_train_examples"] == 2000
        assert manifest["partitioner"] == {"scheme": "dirichlet", "alpha": 0.5, "min_partition_size": 2}
        for split in ("train", "heldout"):
            images, labels = D.client_arrays(spec, pid, split=split)
            got_images, got_labels = shards.shard_arrays(folder, split)
            np.testing.assert_array_equal(got_images, images)  # same pixels, same order
            np.testing.assert_array_equal(got_labels, labels)
            entry = manifest["splits"][split]
            assert entry["class_counts"] == np.bincount(labels, minlength=10).tolist()
            assert entry["num_examples"] == len(labels) > 0
            digest = hashlib.sha256(images.astype(np.uint8).tobytes() + labels.astype("<i8").tobytes())
            assert entry["sha256"] == digest.hexdigest()
            sim, node = D.client_dataset(spec, pid, split=split), shards.load_shard(folder, split)
            assert type(node) is type(sim) and node.num_classes == sim.num_classes == 10
            assert torch.equal(node.images, sim.images) and torch.equal(node.labels, sim.labels)


@needs_fmnist
def test_shards_are_written_with_the_standard_datasets_format(exported):
    import datasets

    _, out = exported
    dd = datasets.load_from_disk(str(out / "partition-2"))
    assert set(dd) == {"train", "heldout"}
    assert dd["train"].features["image"] == datasets.Array3D(shape=(28, 28, 1), dtype="uint8")
    assert dd["train"].features["label"] == datasets.Value("int64")


def test_export_refuses_text_datasets_and_a_used_folder(tmp_path, capsys):
    assert export_main(["dataset=sentiment", "method=fedlora", f"out={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dataset.name='sentiment'" in err and "fashion_mnist" in err
    assert not (tmp_path / "x").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("")
    assert export_main([*SMALL, "--out", str(tmp_path / "used")]) == 2
    assert "out=" in capsys.readouterr().err
    assert export_main(SMALL) == 2
    assert "out" in capsys.readouterr().err


# --------------------------------------------------------------------------- broken shards


@needs_fmnist
def test_a_corrupted_or_incomplete_shard_is_refused_naming_its_folder(exported, tmp_path):
    _, out = exported
    bad = shutil.copytree(out / "partition-0", tmp_path / "bad")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["splits"]["heldout"]["sha256"] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(manifest))
    shards.load_shard(bad, "train")  # the other split is intact
    with pytest.raises(shards.ShardError, match=f"{bad}.*'heldout'.*checksum"):
        shards.load_shard(bad, "heldout")
    # the pixels changed behind the manifest's back
    images, labels = shards.shard_arrays(out / "partition-0", "train")
    tampered = shutil.copytree(out / "partition-0", tmp_path / "tampered")
    good = json.loads((tampered / "manifest.json").read_text())
    shutil.rmtree(tampered)
    flipped = images.copy()
    flipped[0, 0, 0, 0] ^= 1
    heldout = shards.shard_arrays(out / "partition-0", "heldout")
    shards.write_shard(tampered, {"train": (flipped, labels), "heldout": heldout}, good)
    with pytest.raises(shards.ShardError, match=f"{tampered}.*'train'.*checksum"):
        shards.load_shard(tampered, "train")
    (bad / "manifest.json").unlink()
    with pytest.raises(shards.ShardError, match=f"{bad}: not a shard \\(no manifest.json\\)"):
        shards.load_shard(bad, "train")


def _query(node_config: dict) -> Message:
    """The node's reply to the server's first message (``node-info``), given its node config."""
    LocalGrid(1, {})  # sets the process's task identity, which building a Message needs
    msg = Message(RecordDict({"config": ConfigRecord({"query": "node-info"})}), dst_node_id=1,
                  message_type=MessageType.QUERY)
    return base.handle_query(msg, Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(),
                                          run_config={}))


@needs_fmnist
def test_node_info_reports_the_shard_and_refuses_a_missing_or_broken_one(exported, tmp_path, caplog):
    _, out = exported
    reply = _query({"data-dir": str(out / "partition-3"), "node-name": "ward-7", "capability-level": 0.5})
    assert not reply.has_error()
    assert dict(reply.content["config"]) == {"partition-id": 3, "num-partitions": 4, "node-name": "ward-7",
                                             "capability-level": 0.5}
    (tmp_path / "empty").mkdir()
    for node_config in [{"data-dir": str(tmp_path / "empty")}, {"data-dir": str(tmp_path / "nowhere")}]:
        reply = _query(node_config)
        assert reply.has_error() and f"data-dir={node_config['data-dir']}" in reply.error.reason
        assert "no shard there" in reply.error.reason and "python -m fedhm_flwr.ops.shards" in reply.error.reason
    with pytest.raises(base.NodeDataError, match="lacks data-dir.*python -m fedhm_flwr.ops.shards"):
        base.node_shard(Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    broken = shutil.copytree(out / "partition-1", tmp_path / "broken")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["splits"]["train"]["sha256"] = "f" * 64
    (broken / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reply = _query({"data-dir": str(broken)})
    assert reply.has_error() and f"data-dir={broken}" in reply.error.reason and "checksum" in reply.error.reason
    # the device says it too, in its own log, in one line
    (line,) = [r.getMessage() for r in caplog.records if "sits out" in r.getMessage()]
    assert line.startswith("this node sits out of the run: ") and f"data-dir={broken}" in line and "\n" not in line


# --------------------------------------------------------------------------- a node opens only its shard

NODE_SCRIPT = textwrap.dedent("""
    import json, sys
    opened, recording = [], [True]
    def hook(event, args):
        if recording[0] and event == "open" and isinstance(args[0], (str, bytes)):
            opened.append(args[0] if isinstance(args[0], str) else args[0].decode())
    sys.addaudithook(hook)
    from flwr.app import ArrayRecord, Message, MessageType, RecordDict
    from fedhm_flwr.config import load_config, model_spec
    from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.server_app import initial_state
    from strategies import FedHMStrategy
    folders, overrides = json.loads(sys.argv[1]), sys.argv[2:]
    cfg = load_config(overrides)
    strategy = FedHMStrategy(cfg, model_spec(cfg))
    # the nodes are given their shard only (LocalGrid's partition-id is not what they read)
    grid = LocalGrid(len(folders), client_handlers(), node_config=lambda i: {"data-dir": folders[i]})
    state = ArrayRecord.from_torch_state_dict(initial_state(cfg, strategy.spec))
    msgs = list(strategy.configure_train(1, state, None, grid))
    replies = grid.send_and_receive(msgs)
    evals = [Message(RecordDict({"arrays": m.content["arrays"], "config": m.content["config"]}),
                     dst_node_id=m.metadata.dst_node_id, message_type=MessageType.EVALUATE) for m in msgs]
    results = {}
    for kind, batch in (("train", replies), ("evaluate", grid.send_and_receive(evals))):
        for r in batch:
            assert not r.has_error(), r.error.reason
            results.setdefault(kind, []).append(int(r.content["metrics"]["num-examples"]))
    shard_phase = list(opened)
    from fedhm_flwr import data  # control: the same hook sees a simulation-like load of the system copy
    data.client_dataset(data.make_data_spec("fashion_mnist", 4), 0, data.FASHION_MNIST_SYSTEM_DIR)
    recording[0] = False
    print(json.dumps({"opened": shard_phase, "control": opened[len(shard_phase):], "results": results}))
""")


@needs_fmnist
def test_a_node_with_a_shard_never_opens_another_data_source(exported, tmp_path):
    spec, out = exported
    folders = [str(out / f"partition-{i}") for i in range(3)]
    empty = tmp_path / "no-data"
    empty.mkdir()
    env = {**os.environ, D.DATA_DIR_ENV: str(empty), "PYTHONPATH": str(REPO)}
    overrides = [*SMALL, "model.width=8", "train.batch_size=64", "fraction_train=1.0", "min_train_nodes=3"]
    proc = subprocess.run([sys.executable, "-c", NODE_SCRIPT, json.dumps(folders), *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    manifests = [json.loads((Path(f) / "manifest.json").read_text()) for f in folders]
    assert sorted(report["results"]["train"]) == sorted(m["splits"]["train"]["num_examples"] for m in manifests)
    assert sorted(report["results"]["evaluate"]) == sorted(m["splits"]["heldout"]["num_examples"] for m in manifests)
    # the shards, the code (the repo, the Python installation with its site-packages), the kernel's
    # pseudo-files, time-zone data, and tempfile's writability probe (a random 8-character name)
    allowed = [str(out), str(REPO), sys.prefix, sys.base_prefix, "/proc/", "/sys/", "/dev/", "/usr/share/zoneinfo/"]
    probe = re.compile(re.escape(tempfile.gettempdir()) + "/[a-z0-9_]{8}$")
    opened = {os.path.abspath(p) for p in report["opened"]}
    foreign = sorted(p for p in opened if not any(p.startswith(a) for a in allowed) and not probe.match(p))
    assert foreign == []
    assert not any(p.startswith(D.FASHION_MNIST_SYSTEM_DIR) or p.startswith(str(empty)) for p in opened)
    assert any(p.startswith(str(out / "partition-0")) for p in opened)  # the shards were read
    # the hook does see dataset files when they are opened
    assert any(p.startswith(D.FASHION_MNIST_SYSTEM_DIR) for p in report["control"])


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
    proc = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, "dataset=cifar10", f"dataset.data_dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
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
    with pytest.raises(ConfigError, match="FEDHM_DATA_DIR.*simulated clients' training data") as err:
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
    with pytest.raises(ConfigError, match="dataset.data_dir=.*Fashion-MNIST test files.*apt-get install") as err:
        check_data_available(load_config([f"dataset.data_dir={tmp_path}"]), simulation=False)
    assert err.value.field == "dataset.data_dir" and "\n" not in str(err.value)
    monkeypatch.setenv(D.DATA_DIR_ENV, str(tmp_path))  # an empty $FEDHM_DATA_DIR: the system copy, as loading does
    check_data_available(load_config([]), simulation=True)


def test_a_shard_written_by_hand_as_docs_deploy_describes_loads(tmp_path):
    """docs/DEPLOY.md, "Shard format": a user's own data, written with `datasets` and hashlib only."""
    from datasets import Array3D, Dataset, DatasetDict, Features, Value

    rng = np.random.default_rng(0)
    train_x, train_y = rng.integers(0, 256, (9, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, 9)
    held_x, held_y = np.zeros((0, 28, 28, 1), np.uint8), np.zeros(0, np.int64)

    def split(images, labels):
        features = Features({"image": Array3D(shape=images.shape[1:], dtype="uint8"), "label": Value("int64")})
        return Dataset.from_dict({"image": images, "label": labels.astype(np.int64)}, features=features)

    def entry(images, labels):
        digest = hashlib.sha256(np.ascontiguousarray(images, np.uint8).tobytes()
                                + np.ascontiguousarray(labels, "<i8").tobytes()).hexdigest()
        return {"num_examples": len(labels), "sha256": digest,
                "class_counts": np.bincount(labels, minlength=10).tolist()}

    DatasetDict({"train": split(train_x, train_y), "heldout": split(held_x, held_y)}).save_to_disk(
        str(tmp_path), num_shards={"train": 1, "heldout": 1})
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "fedhm-shard", "format_version": 1, "dataset": "fashion_mnist", "num_classes": 10,
        "in_channels": 1, "image_size": 28, "mean": [0.5], "std": [0.25],
        "splits": {"train": entry(train_x, train_y), "heldout": entry(held_x, held_y)}}))
    ds = shards.load_shard(tmp_path, "train")
    expected = (torch.from_numpy(train_x.transpose(0, 3, 1, 2).astype(np.float32)) / 255 - 0.5) / 0.25
    assert torch.allclose(ds.images, expected) and ds.labels.tolist() == train_y.tolist()
    assert len(shards.load_shard(tmp_path, "heldout")) == 0
    reply = _query({"data-dir": str(tmp_path)})  # no partition id in a user's manifest: none reported
    assert not reply.has_error() and dict(reply.content["config"]) == {}


def _train_messages(cfg, grid):
    from fedhm_flwr.config import model_spec
    from fedhm_flwr.ops.server_app import initial_state
    from fedhm_flwr.server.registry import FedHMStrategy

    strategy = FedHMStrategy(cfg, model_spec(cfg))
    state = ArrayRecord.from_torch_state_dict(initial_state(cfg, strategy.spec))
    return list(strategy.configure_train(1, state, None, grid))


def _as_evaluate(msg: Message) -> Message:
    return Message(RecordDict({"arrays": msg.content["arrays"], "config": msg.content["config"]}),
                   dst_node_id=msg.metadata.dst_node_id, message_type=MessageType.EVALUATE)


@needs_fmnist
def test_a_node_without_held_out_examples_answers_evaluate_with_an_error(toy_cfg):
    cfg = toy_cfg()  # evaluation.where=server: nodes hold nothing out
    grid = LocalGrid(6, client_handlers())
    replies = grid.send_and_receive([_as_evaluate(m) for m in _train_messages(cfg, grid)[:2]])
    assert replies and all(r.has_error() and "no held-out examples" in r.error.reason for r in replies)
    assert all("evaluation.holdout" in r.error.reason for r in replies)


@needs_fmnist
def test_a_shard_of_another_dataset_is_refused_naming_both(exported, toy_cfg):
    _, out = exported
    cfg = toy_cfg("min_train_nodes=1")
    grid = LocalGrid(1, client_handlers(), node_config=lambda i: {"data-dir": str(out / "partition-0")})
    (msg,) = _train_messages(cfg, grid)[:1]
    spec = json.loads(str(msg.content["config"]["data-spec"]))
    msg.content["config"]["data-spec"] = json.dumps({**spec, "name": "cifar10"})
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and f"data-dir={out / 'partition-0'}" in reply.error.reason
    assert "'fashion_mnist'" in reply.error.reason and "dataset.name='cifar10'" in reply.error.reason
