"""Per-node shards: export (the simulation's partitions, in the standard ``datasets`` format),
load, broken shards refused, the node side (node info, only its shard opened), a shard written by
hand, a shard of another dataset. The held-out split and the data check before start are in
tests/test_node_data.py.

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
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import REPO, needs_fmnist, train_messages
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedhm_flwr import data as D
from fedhm_flwr.client import handlers as base
from fedhm_flwr.config import data_spec, load_config
from fedhm_flwr.data import shards
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.deploy.shard_export import main as export_main

SMALL = ["num_clients=4", "dataset.max_train_examples=2000", "evaluation.where=both"]
pytestmark = pytest.mark.usefixtures("no_env_data_dir")  # tests/conftest.py


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The small run's shards, written through the command line's entry point."""
    out = tmp_path_factory.mktemp("shards") / "out"
    assert export_main([*SMALL, f"out={out}"]) == 0
    return D.check_data_spec(data_spec(load_config(SMALL))), out


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
    msg = Message(
        RecordDict({"config": ConfigRecord({"query": "node-info"})}), dst_node_id=1, message_type=MessageType.QUERY
    )
    return base.handle_query(
        msg, Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    )


@needs_fmnist
def test_node_info_reports_the_shard_and_refuses_a_missing_or_broken_one(exported, tmp_path, caplog):
    _, out = exported
    reply = _query({"data-dir": str(out / "partition-3"), "node-name": "ward-7", "capability-level": 0.5})
    assert not reply.has_error()
    assert dict(reply.content["config"]) == {
        "partition-id": 3,
        "num-partitions": 4,
        "node-name": "ward-7",
        "capability-level": 0.5,
    }
    (tmp_path / "empty").mkdir()
    for node_config in [{"data-dir": str(tmp_path / "empty")}, {"data-dir": str(tmp_path / "nowhere")}]:
        reply = _query(node_config)
        assert reply.has_error() and f"data-dir={node_config['data-dir']}" in reply.error.reason
        assert (
            "no shard there" in reply.error.reason
            and "python -m fedhm_flwr.ops.deploy.shard_export" in reply.error.reason
        )
    with pytest.raises(base.NodeDataError, match=r"lacks data-dir.*python -m fedhm_flwr\.ops\.deploy\.shard_export"):
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
    from fedhm_flwr.config import load_config, model_spec, run_options
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import initial_state
    from strategies import FedHMStrategy
    folders, overrides = json.loads(sys.argv[1]), sys.argv[2:]
    cfg = load_config(overrides)
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    # the nodes are given their shard only (LocalGrid's partition-id is not what they read)
    grid = LocalGrid(len(folders), client_handlers(), node_config=lambda i: {"data-dir": folders[i]})
    state = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
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
    _spec, out = exported
    folders = [str(out / f"partition-{i}") for i in range(3)]
    empty = tmp_path / "no-data"
    empty.mkdir()
    env = {**os.environ, D.DATA_DIR_ENV: str(empty), "PYTHONPATH": str(REPO)}
    overrides = [*SMALL, "model.width=8", "train.batch_size=64", "fraction_train=1.0", "min_train_nodes=3"]
    proc = subprocess.run(
        [sys.executable, "-c", NODE_SCRIPT, json.dumps(folders), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
        digest = hashlib.sha256(
            np.ascontiguousarray(images, np.uint8).tobytes() + np.ascontiguousarray(labels, "<i8").tobytes()
        ).hexdigest()
        return {
            "num_examples": len(labels),
            "sha256": digest,
            "class_counts": np.bincount(labels, minlength=10).tolist(),
        }

    DatasetDict({"train": split(train_x, train_y), "heldout": split(held_x, held_y)}).save_to_disk(
        str(tmp_path), num_shards={"train": 1, "heldout": 1}
    )
    (tmp_path / "manifest.json").write_text(
        json.dumps(
            {
                "format": "fedhm-shard",
                "format_version": 1,
                "dataset": "fashion_mnist",
                "num_classes": 10,
                "in_channels": 1,
                "image_size": 28,
                "mean": [0.5],
                "std": [0.25],
                "splits": {"train": entry(train_x, train_y), "heldout": entry(held_x, held_y)},
            }
        )
    )
    ds = shards.load_shard(tmp_path, "train")
    expected = (torch.from_numpy(train_x.transpose(0, 3, 1, 2).astype(np.float32)) / 255 - 0.5) / 0.25
    assert torch.allclose(ds.images, expected) and ds.labels.tolist() == train_y.tolist()
    assert len(shards.load_shard(tmp_path, "heldout")) == 0
    reply = _query({"data-dir": str(tmp_path)})  # no partition id in a user's manifest: none reported
    assert not reply.has_error() and dict(reply.content["config"]) == {}


@needs_fmnist
def test_a_shard_of_another_dataset_is_refused_naming_both(exported, toy_cfg):
    _, out = exported
    cfg = toy_cfg("min_train_nodes=1")
    grid = LocalGrid(1, client_handlers(), node_config=lambda i: {"data-dir": str(out / "partition-0")})
    (msg,) = train_messages(cfg, grid)[:1]
    spec = json.loads(str(msg.content["config"]["data-spec"]))
    msg.content["config"]["data-spec"] = json.dumps({**spec, "name": "cifar10"})
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and f"data-dir={out / 'partition-0'}" in reply.error.reason
    assert "'fashion_mnist'" in reply.error.reason and "dataset.name='cifar10'" in reply.error.reason
