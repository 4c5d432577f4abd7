"""Tests of fedhm_flwr.data on the real Fashion-MNIST files (Debian package) and on
small synthetic files (IDX, a fake CIFAR folder). No downloads, no network."""

from __future__ import annotations

import gzip
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import fake_cifar10

from fedhm_flwr import data as D
from fedhm_flwr.data.idx import read_idx

FMNIST_DIR = Path(D.FASHION_MNIST_SYSTEM_DIR)
FMNIST_FILES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]
HAVE_FMNIST = all((FMNIST_DIR / f).is_file() for f in FMNIST_FILES)
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST,
    reason=f"Fashion-MNIST IDX files not in {FMNIST_DIR} (apt-get install dataset-fashion-mnist)",
)


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests must not depend on the caller's FEDHM_DATA_DIR."""
    monkeypatch.delenv(D.DATA_DIR_ENV, raising=False)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails the test loudly."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def train_labels() -> np.ndarray:
    return D.load_arrays("fashion_mnist", "train")[1]


def entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# --------------------------------------------------------------------------- registry


def test_dataset_info_and_registry() -> None:
    assert D.dataset_info("fashion_mnist") == {
        "num_classes": 10,
        "in_channels": 1,
        "image_size": 28,
    }
    assert D.dataset_info("cifar10") == {"num_classes": 10, "in_channels": 3, "image_size": 32}
    assert D.dataset_info("cifar100")["num_classes"] == 100
    for info in D.DATASETS.values():
        assert len(info.mean) == len(info.std) == info.in_channels
    with pytest.raises(ValueError, match=r"dataset\.name.*'cifar10'"):
        D.dataset_info("mnist")


# --------------------------------------------------------------------------- IDX / loading


def _write_idx(path: Path, arr: np.ndarray, code: int, compress: bool) -> None:
    header = bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    payload = header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_roundtrip_and_bad_files(tmp_path: Path, compress: bool) -> None:
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
    ints = rng.integers(-1000, 1000, size=(7,), dtype=np.int32)
    p1 = tmp_path / ("a.gz" if compress else "a")
    p2 = tmp_path / ("b.gz" if compress else "b")
    _write_idx(p1, img, 0x08, compress)
    _write_idx(p2, ints, 0x0C, compress)
    np.testing.assert_array_equal(read_idx(p1), img)
    np.testing.assert_array_equal(read_idx(p2), ints)
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + np.asarray([10], dtype=">u4").tobytes() + b"x")
    with pytest.raises(ValueError, match="payload"):
        read_idx(short)


@needs_fmnist
def test_load_fashion_mnist_arrays() -> None:
    x, y = D.load_arrays("fashion_mnist", "train")
    assert x.shape == (60000, 28, 28, 1) and x.dtype == np.uint8
    assert y.shape == (60000,) and y.dtype == np.int64
    assert x.min() == 0 and x.max() == 255
    np.testing.assert_array_equal(np.bincount(y), np.full(10, 6000))
    xt, yt = D.load_arrays("fashion_mnist", "test")
    assert xt.shape == (10000, 28, 28, 1) and yt.shape == (10000,)
    np.testing.assert_array_equal(np.bincount(yt), np.full(10, 1000))
    # cached and protected
    assert D.load_arrays("fashion_mnist", "train")[0] is x
    assert not x.flags.writeable
    # registry's normalisation constants are the training set's statistics
    info = D.DATASETS["fashion_mnist"]
    sample = x[::7].astype(np.float64) / 255
    assert sample.mean() == pytest.approx(info.mean[0], abs=2e-3)
    assert sample.std() == pytest.approx(info.std[0], abs=2e-3)


@needs_fmnist
def test_fashion_mnist_from_explicit_dir_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchvision-style layout with the .gz files, given as data_dir
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for f in FMNIST_FILES[2:]:
        (raw / f).symlink_to(FMNIST_DIR / f)
    _xt, yt = D.load_arrays("fashion_mnist", "test", data_dir=tmp_path)
    np.testing.assert_array_equal(yt, D.load_arrays("fashion_mnist", "test")[1])
    # an env data root without Fashion-MNIST falls back to the system path
    monkeypatch.setenv(D.DATA_DIR_ENV, str(tmp_path / "elsewhere"))
    assert D.load_arrays("fashion_mnist", "test")[0].shape == (10000, 28, 28, 1)


def test_missing_fashion_mnist_dir_names_apt_get(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as e:
        D.load_arrays("fashion_mnist", "train", data_dir=missing)
    assert str(missing) in str(e.value)


def test_unknown_split_refused() -> None:
    with pytest.raises(ValueError, match="split"):
        D.load_arrays("fashion_mnist", "validation")


# --------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_missing_without_download_is_file_not_found(tmp_path: Path, name: str, no_network: None) -> None:
    with pytest.raises(FileNotFoundError, match="download"):
        D.load_arrays(name, "train", data_dir=tmp_path)
    spec = D.make_data_spec(name, 2)
    with pytest.raises(FileNotFoundError):
        D.test_dataset(spec, data_dir=tmp_path)
    assert not any(tmp_path.iterdir()), "nothing may be written without download"


def test_cifar10_local_folder_and_augmentation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    import torchvision.datasets.cifar as tv_cifar

    fake_cifar10(tmp_path)
    # the fake files cannot match torchvision's md5 sums
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    x, y = D.load_arrays("cifar10", "train", data_dir=tmp_path / "cifar-10-batches-py")
    assert x.shape == (100, 32, 32, 3) and x.dtype == np.uint8 and y.dtype == np.int64
    spec = D.make_data_spec("cifar10", 4, scheme="iid", augment=True)
    ds = D.client_dataset(spec, 1, data_dir=tmp_path)
    assert len(ds) == 25 and ds.transform is not None
    img, label = ds[0]
    assert img.shape == (3, 32, 32) and img.dtype == torch.float32
    assert label.dtype == torch.int64
    # raw pixel check: the stored tensor is the normalised uint8 image, NHWC -> NCHW
    idx = D.partition_indices(spec, tmp_path)[1]
    info = D.DATASETS["cifar10"]
    expect = (x[idx[0]].transpose(2, 0, 1) / 255.0 - np.array(info.mean)[:, None, None]) / (
        np.array(info.std)[:, None, None]
    )
    np.testing.assert_allclose(ds.images[0].numpy(), expect, atol=1e-5)
    # augmentation: crop/flip keep the shape and pad with black (pixel 0)
    torch.manual_seed(0)
    outs = torch.stack([ds[0][0] for _ in range(40)])
    assert not torch.allclose(outs, outs[:1].expand_as(outs))
    # padding is black (raw pixel 0), i.e. -mean/std after normalisation
    black = torch.tensor([-m / s for m, s in zip(info.mean, info.std)]).view(3, 1, 1)
    const = torch.full((3, 32, 32), 5.0)
    crops = torch.stack([ds.transform(const) for _ in range(40)])
    is_black = torch.isclose(crops, black.expand_as(crops), atol=1e-5)
    assert (is_black | (crops == 5.0)).all() and is_black.any()
    # test split: no augmentation
    test = D.test_dataset(spec, data_dir=tmp_path)
    assert len(test) == 20 and test.transform is None


# --------------------------------------------------------------------------- partitions


def _assert_disjoint(parts: list[np.ndarray]) -> np.ndarray:
    allp = np.concatenate(parts)
    assert len(np.unique(allp)) == len(allp), "partitions overlap"
    return allp


@needs_fmnist
@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_iid_dirichlet_cover_disjoint_and_seeded(scheme: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDHM_CACHE", str(tmp_path / "first"))
    y = train_labels()
    parts = D.partition(y, 10, scheme, seed=3, alpha=0.5)
    assert len(parts) == 10
    allp = _assert_disjoint(parts)
    np.testing.assert_array_equal(np.sort(allp), np.arange(len(y)))
    assert all(len(p) >= 2 for p in parts)
    if scheme == "iid":
        assert {len(p) for p in parts} == {6000}
    D.clear_caches()  # recompute, not just a cache hit (in memory or on disk)
    monkeypatch.setenv("FEDHM_CACHE", str(tmp_path / "again"))
    again = D.partition(D.load_arrays("fashion_mnist", "train")[1], 10, scheme, seed=3)
    for a, b in zip(parts, again):
        np.testing.assert_array_equal(a, b)
    other = D.partition(y, 10, scheme, seed=4)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


@needs_fmnist
@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used")
@pytest.mark.parametrize("mode", ["deterministic", "random"])
@pytest.mark.parametrize("cpp", [1, 2, 3])
def test_pathological_classes_per_partition(mode: str, cpp: int) -> None:
    y = train_labels()
    parts = D.partition(y, 20, "pathological", seed=0, classes_per_partition=cpp, class_assignment=mode)
    _assert_disjoint(parts)
    for p in parts:
        assert 1 <= len(np.unique(y[p])) <= cpp
    if mode == "deterministic":
        # 20 partitions cycle over all 10 classes: the whole set is used
        assert sum(len(p) for p in parts) == len(y)


@needs_fmnist
def test_dirichlet_small_alpha_is_more_skewed() -> None:
    y = train_labels()

    def mean_entropy(alpha: float) -> float:
        parts = D.partition(y, 20, "dirichlet", seed=0, alpha=alpha)
        return float(np.mean([entropy(np.bincount(y[p], minlength=10)) for p in parts]))

    skewed, mild, flat = mean_entropy(0.1), mean_entropy(1.0), mean_entropy(100.0)
    assert skewed < mild < flat
    assert flat > 0.95 * np.log(10)


def test_partition_refuses_bad_arguments() -> None:
    y = np.arange(100) % 10
    with pytest.raises(ValueError, match=r"partition\.scheme.*'dirichlet'"):
        D.partition(y, 5, "shards", seed=0)
    with pytest.raises(ValueError, match=r"partition\.alpha"):
        D.partition(y, 5, "dirichlet", seed=0, alpha=0.0)
    with pytest.raises(ValueError, match=r"partition\.num_partitions"):
        D.partition(y, 101, "iid", seed=0)
    with pytest.raises(ValueError, match=r"partition\.classes_per_partition"):
        D.partition(y, 5, "pathological", seed=0, classes_per_partition=11)
    with pytest.raises(ValueError, match=r"partition\.class_assignment"):
        D.partition(y, 5, "pathological", seed=0, class_assignment="roundrobin")


def test_partition_on_synthetic_labels_is_exact() -> None:
    y = np.repeat(np.arange(4), 25)
    parts = D.partition(y, 4, "pathological", seed=0, classes_per_partition=1)
    assert sorted(int(np.unique(y[p])[0]) for p in parts) == [0, 1, 2, 3]
    assert all(len(p) == 25 for p in parts)


# --------------------------------------------------------------------------- data spec


def test_data_spec_defaults_and_validation() -> None:
    spec = D.make_data_spec("fashion_mnist", 10)
    assert spec == {"name": "fashion_mnist", "num_partitions": 10, **D.DATA_SPEC_DEFAULTS}
    assert D.check_data_spec({**spec, "alpha": 1, "augment": 1})["alpha"] == 1.0
    with pytest.raises(ValueError, match=r"dataset\.name"):
        D.make_data_spec("imagenet", 10)
    with pytest.raises(ValueError, match=r"partition\.scheme.*'pathological'"):
        D.make_data_spec("fashion_mnist", 10, scheme="shards")
    with pytest.raises(ValueError, match="unknown key"):
        D.make_data_spec("fashion_mnist", 10, alhpa=0.1)
    with pytest.raises(ValueError, match="missing required"):
        D.check_data_spec({"name": "fashion_mnist"})
    with pytest.raises(ValueError, match=r"partition\.num_partitions"):
        D.make_data_spec("fashion_mnist", 0)
    with pytest.raises(ValueError, match=r"dataset\.augment"):
        D.make_data_spec("fashion_mnist", 2, augment="yes")


@needs_fmnist
def test_partition_id_refused_naming_the_field() -> None:
    spec = D.make_data_spec("fashion_mnist", 4, max_train_examples=400)
    for bad in (4, -1, "1", True):
        with pytest.raises(ValueError, match="partition-id"):
            D.client_dataset(spec, bad, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partition-id"):
        D.client_labels(spec, 7, None)


# --------------------------------------------------------------------------- torch datasets


@needs_fmnist
def test_client_dataset_is_normalised_tensors() -> None:
    spec = D.make_data_spec("fashion_mnist", 2, scheme="iid", seed=0)
    ds = D.client_dataset(spec, 0, None)
    assert len(ds) == 30000
    assert ds.images.shape == (30000, 1, 28, 28) and ds.images.dtype == torch.float32
    assert ds.labels.dtype == torch.int64 and ds.transform is None
    assert abs(float(ds.images.mean())) < 0.02
    assert float(ds.images.std()) == pytest.approx(1.0, abs=0.02)
    x, label = ds[5]
    assert x.shape == (1, 28, 28) and int(label) == int(ds.labels[5])
    np.testing.assert_array_equal(ds.label_array(), D.client_labels(spec, 0, None))
    # augment is a no-op for Fashion-MNIST
    assert D.client_dataset({**spec, "augment": True}, 1, None).transform is None


@needs_fmnist
def test_max_train_examples_subset_then_partition() -> None:
    spec = D.make_data_spec("fashion_mnist", 5, scheme="dirichlet", alpha=0.3, seed=7, max_train_examples=3000)
    parts = D.partition_indices(spec)
    allp = _assert_disjoint(parts)
    assert len(allp) == 3000
    for a, b in zip(D.partition_indices(spec), parts):
        np.testing.assert_array_equal(a, b)
    sizes = [len(D.client_dataset(spec, i, None)) for i in range(5)]
    assert sizes == [len(p) for p in parts]
    summary = D.partition_summary(spec)
    assert [s["size"] for s in summary] == sizes
    assert sum(sum(s["class_counts"]) for s in summary) == 3000
    for s, p in zip(summary, parts):
        counts = np.bincount(train_labels()[p], minlength=10)
        assert s["class_counts"] == counts.tolist()
        assert s["num_classes_present"] == int((counts > 0).sum())
    # another seed draws another subset
    other = D.partition_indices({**spec, "seed": 8})
    assert not np.array_equal(np.sort(np.concatenate(other)), np.sort(allp))


@needs_fmnist
def test_test_dataset_full_and_subset() -> None:
    spec = D.make_data_spec("fashion_mnist", 3)
    full = D.test_dataset(spec)
    assert len(full) == 10000 and full.transform is None
    assert full.images.shape == (10000, 1, 28, 28)
    assert abs(float(full.images.mean())) < 0.05
    small = D.test_dataset({**spec, "max_test_examples": 500})
    assert len(small) == 500
    again = D.test_dataset({**spec, "max_test_examples": 500})
    assert torch.equal(small.labels, again.labels)
    assert torch.equal(small.images, again.images)
    assert np.bincount(small.label_array(), minlength=10).min() > 0
