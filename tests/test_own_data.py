"""Your own data: an image folder (torchvision ImageFolder layout) and a `datasets` save_to_disk folder.

Every image is written with its identity in its pixels (channel 0: its class folder's code, channel
1: its number), so that loading, class order, splits, partitions and shards are checked against
what was written, not against the code under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from fedhm_flwr import data as D
from fedhm_flwr.config import ConfigError, data_spec, load_config, model_spec
from fedhm_flwr.data import shards
from fedhm_flwr.data.files import check_data_available

# written in this order on purpose: class ids follow the sorted folder names (ant=0, bee=1, zebra=2)
CLASSES = ("zebra", "ant", "bee")
CODE = {"zebra": 200, "ant": 40, "bee": 120}
PER_CLASS = 12


def _pixels(name: str, i: int) -> np.ndarray:
    img = np.zeros((8, 8, 3), dtype=np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = CODE[name], i, 7
    return img


def _image_folder(root, classes=CLASSES, per_class=PER_CLASS, first=0):
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(first, first + per_class):
            Image.fromarray(_pixels(name, i)).save(root / name / f"{i}.png")
    return root


def _identities(images: np.ndarray) -> list[tuple[str, int]]:
    """(class folder, number) of each loaded image, read back from its pixels."""
    by_code = {v: k for k, v in CODE.items()}
    return [(by_code[int(x[0, 0, 0])], int(x[0, 0, 1])) for x in images]


def _cfg(root, *extra):
    return load_config(
        [
            "dataset=imagefolder",
            f"dataset.path={root}",
            "dataset.image_size=8",
            "num_clients=3",
            "dataset.test_fraction=0.25",
            *extra,
        ]
    )


@pytest.fixture(autouse=True)
def _fresh_caches():
    D.clear_caches()
    yield
    D.clear_caches()


def test_image_folder_loads_every_image_once_with_sorted_class_ids_and_a_stratified_test_split(tmp_path):
    cfg = _cfg(_image_folder(tmp_path / "imgs"))
    assert model_spec(cfg)["num_classes"] == 3 and model_spec(cfg)["in_channels"] == 3
    spec = D.check_data_spec(data_spec(cfg))
    (xtr, ytr), (xte, yte) = D.source_arrays(spec, "train"), D.source_arrays(spec, "test")
    assert xtr.shape == (27, 8, 8, 3) and xte.shape == (9, 8, 8, 3)  # round(0.25 * 12) = 3 per class held out
    seen = _identities(xtr) + _identities(xte)
    assert sorted(seen) == sorted((c, i) for c in CLASSES for i in range(PER_CLASS))  # each image exactly once
    order = sorted(CLASSES)
    assert [order.index(c) for c, _ in seen] == [*ytr.tolist(), *yte.tolist()]  # label = sorted folder position
    assert np.bincount(yte, minlength=3).tolist() == [3, 3, 3]
    assert [c for c, _ in _identities(xtr)] and all((x[..., 2] == 7).all() for x in xtr)  # pixels as written
    # the test split does not depend on the run's seed
    again = D.check_data_spec(data_spec(_cfg(tmp_path / "imgs", "seed=5")))
    assert _identities(D.source_arrays(again, "test")[0]) == _identities(xte)


def test_train_and_val_folders_keep_the_training_class_ids(tmp_path):
    root = tmp_path / "split"
    _image_folder(root / "train", per_class=4)
    _image_folder(root / "val", classes=("zebra",), per_class=2, first=50)  # the test split lacks classes
    spec = D.check_data_spec(data_spec(_cfg(root)))
    xte, yte = D.source_arrays(spec, "test")
    assert _identities(xte) == [("zebra", 50), ("zebra", 51)] and yte.tolist() == [2, 2]
    assert len(D.source_arrays(spec, "train")[1]) == 12 and len(D.test_dataset(spec)) == 2


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "pathological"])
def test_partitions_of_an_image_folder_cover_its_training_split_exactly_once(tmp_path, scheme):
    spec = D.check_data_spec(data_spec(_cfg(_image_folder(tmp_path / "imgs"), f"partition.scheme={scheme}")))
    parts = D.partition_indices(spec)
    joined = np.concatenate(parts)
    if scheme == "pathological":  # 2 classes each, deterministic: 3 clients take all 3 classes
        assert all(len(np.unique(D.source_arrays(spec, "train")[1][p])) <= 2 for p in parts)
    assert len(parts) == 3 and sorted(joined.tolist()) == list(range(27))
    ds = D.client_dataset(spec, 1)
    assert ds.images.shape == (len(parts[1]), 3, 8, 8) and ds.num_classes == 3


def test_shards_of_an_image_folder_hold_the_simulation_partitions(tmp_path):
    cfg = _cfg(_image_folder(tmp_path / "imgs"), "evaluation.where=both", "evaluation.holdout=0.25")
    spec = D.check_data_spec(data_spec(cfg))
    written = shards.export_shards(spec, tmp_path / "shards", echo=lambda line: None)
    assert len(written) == 3
    total = 0
    for pid, folder in enumerate(written):
        manifest = shards.verify_shard(folder)
        assert manifest["dataset"] == "imagefolder" and manifest["num_classes"] == 3 and manifest["image_size"] == 8
        for split in D.CLIENT_SPLITS:
            sim, node = D.client_dataset(spec, pid, split=split), shards.load_shard(folder, split)
            assert torch.equal(sim.images, node.images) and torch.equal(sim.labels, node.labels)
            total += len(node)
    assert total == 27


def _hf_split(names: list[str], start: int, features):
    import datasets

    images = [Image.fromarray(_pixels(n, start + i)) for i, n in enumerate(names)]
    return datasets.Dataset.from_dict(
        {"picture": images, "y": [sorted(CLASSES).index(n) for n in names]}, features=features
    )


def test_hf_disk_dataset_dict_and_single_dataset_load_with_their_labels(tmp_path):
    import datasets

    features = datasets.Features({"picture": datasets.Image(), "y": datasets.ClassLabel(names=sorted(CLASSES))})
    train_names = [c for c in CLASSES for _ in range(6)]
    datasets.DatasetDict(
        {"train": _hf_split(train_names, 0, features), "validation": _hf_split(["bee", "ant"], 100, features)}
    ).save_to_disk(str(tmp_path / "dd"))
    cfg = load_config(
        [
            "dataset=hf_disk",
            f"dataset.path={tmp_path / 'dd'}",
            "dataset.image_column=picture",
            "dataset.label_column=y",
            "dataset.image_size=8",
            "num_clients=2",
        ]
    )
    check_data_available(cfg)
    assert model_spec(cfg)["num_classes"] == 3
    spec = D.check_data_spec(data_spec(cfg))
    (xtr, ytr), (xte, yte) = D.source_arrays(spec, "train"), D.source_arrays(spec, "test")
    assert _identities(xtr) == [(n, i) for i, n in enumerate(train_names)]
    assert _identities(xte) == [("bee", 100), ("ant", 101)] and yte.tolist() == [1, 0]
    assert ytr.tolist() == [sorted(CLASSES).index(n) for n in train_names]
    assert sorted(np.concatenate(D.partition_indices(spec)).tolist()) == list(range(18))
    # one Dataset, integer labels, raw uint8 arrays: a fixed-seed stratified test fraction
    raw = datasets.Dataset.from_dict(
        {
            "image": np.stack([_pixels(n, i) for i, n in enumerate(train_names)]),
            "label": [sorted(CLASSES).index(n) for n in train_names],
        },
        features=datasets.Features({"image": datasets.Array3D((8, 8, 3), "uint8"), "label": datasets.Value("int64")}),
    )
    raw.save_to_disk(str(tmp_path / "one"))
    one = D.check_data_spec(
        data_spec(
            load_config(
                [
                    "dataset=hf_disk",
                    f"dataset.path={tmp_path / 'one'}",
                    "dataset.image_size=8",
                    "dataset.test_fraction=0.5",
                ]
            )
        )
    )
    (a, ya), (b, yb) = D.source_arrays(one, "train"), D.source_arrays(one, "test")
    assert np.bincount(yb, minlength=3).tolist() == [3, 3, 3] and len(ya) == 9
    assert sorted(_identities(a) + _identities(b)) == sorted((n, i) for i, n in enumerate(train_names))


def _refusal(overrides) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check_data_available(load_config(overrides))
    assert len(str(err.value).splitlines()) == 1
    return err.value


def test_missing_or_malformed_data_is_refused_before_start_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset\.path=None"):
        load_config(["dataset=imagefolder"])
    err = _refusal(["dataset=imagefolder", f"dataset.path={tmp_path / 'nowhere'}"])
    assert err.field == "dataset.path" and "no such folder" in str(err) and "ImageFolder layout" in str(err)
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(b"")
    assert "no class folders" in str(_refusal(["dataset=imagefolder", f"dataset.path={tmp_path / 'flat'}"]))
    _image_folder(tmp_path / "gap", classes=("ant",), per_class=1)
    (tmp_path / "gap" / "bee").mkdir()
    (tmp_path / "gap" / "bee" / "notes.txt").write_text("no image")
    assert "['bee']" in str(_refusal(["dataset=imagefolder", f"dataset.path={tmp_path / 'gap'}"]))
    with pytest.raises(ConfigError, match=r"dataset\.channels=2"):
        load_config(["dataset=imagefolder", f"dataset.path={tmp_path / 'gap'}", "dataset.channels=2"])
    with pytest.raises(ConfigError, match=r"dataset\.data_dir="):  # one place says where the data is
        load_config(["dataset=imagefolder", f"dataset.path={tmp_path / 'gap'}", f"dataset.data_dir={tmp_path}"])
    err = _refusal(["dataset=hf_disk", f"dataset.path={tmp_path / 'gap'}"])
    assert err.field == "dataset.path" and "save_to_disk" in str(err)
    import datasets

    datasets.Dataset.from_dict({"img": [[1]], "label": [0]}).save_to_disk(str(tmp_path / "hf"))
    err = _refusal(["dataset=hf_disk", f"dataset.path={tmp_path / 'hf'}"])
    assert err.field == "dataset.image_column" and "'img'" in str(err)
    err = _refusal(
        ["dataset=hf_disk", f"dataset.path={tmp_path / 'hf'}", "dataset.image_column=img", "dataset.test_split=test"]
    )
    assert err.field == "dataset.test_split"


def test_two_rounds_of_fedhm_with_the_built_in_cnn_on_an_image_folder(tmp_path):
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run
    from fedhm_flwr.reporting.results import load_checkpoint

    cfg = _cfg(
        _image_folder(tmp_path / "imgs"),
        "rounds=2",
        "fraction_train=1.0",
        "model.width=4",
        "partition.scheme=iid",
        "levels.ratios=[1.0,0.5]",
    )
    check_data_available(cfg)
    summary = run(LocalGrid(3, client_handlers()), cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert 0.0 <= summary["final_acc/global"] <= 1.0
    state, _ = load_checkpoint(tmp_path / "run")
    assert state["fc.weight"].shape[0] == 3  # the model has the folder's 3 classes


def test_an_unreadable_image_is_refused_naming_the_file_and_a_good_listing_is_checked_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHM_CACHE", str(tmp_path / "cache"))
    root = _image_folder(tmp_path / "imgs")
    check_data_available(_cfg(root))
    assert len(list((tmp_path / "cache" / "checked-images").iterdir())) == 1  # the good listing, remembered
    good = (root / "bee" / "3.png").read_bytes()
    (root / "bee" / "3.png").write_bytes(good[: len(good) // 2])  # truncated
    err = _refusal(["dataset=imagefolder", f"dataset.path={root}", "dataset.image_size=8"])
    assert err.field == "dataset.path" and str(root / "bee" / "3.png") in str(err)
    (root / "bee" / "3.png").write_bytes(good)
    (root / "ant" / "junk.png").write_bytes(b"not a png at all")
    assert str(root / "ant" / "junk.png") in str(_refusal(["dataset=imagefolder", f"dataset.path={root}"]))


@pytest.mark.slow
def test_fedhm_run_refuses_a_corrupt_image_before_anything_starts(tmp_path):
    import subprocess
    import sys
    import time

    root = _image_folder(tmp_path / "imgs")
    (root / "zebra" / "5.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    env = {**__import__("os").environ, "FEDHM_CACHE": str(tmp_path / "cache")}
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedhm_flwr",
            "run",
            "dataset=imagefolder",
            f"dataset.path={root}",
            "dataset.image_size=8",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    print(f"refused in {time.monotonic() - t0:.1f} s")
    assert done.returncode == 2, done.stderr
    assert str(root / "zebra" / "5.png") in done.stderr.strip().splitlines()[-1]  # the last line names the file
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()  # before the run directory
