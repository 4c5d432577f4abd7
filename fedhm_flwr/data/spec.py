"""The data spec: the plain dict every message carries; validation and defaults (schema in
:mod:`fedhm_flwr.data`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedhm_flwr.data.catalog import EXTERNAL_DATASETS, FOLDER_SOURCES, image_info

PARTITION_SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "pathological")
CLASS_ASSIGNMENTS: tuple[str, ...] = ("deterministic", "random", "first-deterministic")

#: the splits of one partition: what a node trains on, and what it holds out for evaluation
CLIENT_SPLITS: tuple[str, ...] = ("train", "heldout")


def check_int(field: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------- data spec

DATA_SPEC_DEFAULTS: dict[str, Any] = {
    "scheme": "iid",
    "alpha": 0.5,
    "classes_per_partition": 2,
    "seed": 0,
    "max_train_examples": 0,
    "max_test_examples": 0,
    "augment": False,
    "download": False,
    "class_assignment": "deterministic",
    "min_partition_size": 2,
    "holdout": 0.0,  # fraction of each partition held out (seeded) for client-side evaluation
}
_REQUIRED_KEYS = ("name", "num_partitions")

_IMAGE_SOURCE_DEFAULTS: dict[str, Any] = {
    "path": None,  # the folder (required)
    "image_size": 32,  # images are resized (shorter side) and centre-cropped to this square
    "channels": 3,  # 1: grayscale, 3: RGB
    "test_fraction": 0.2,  # without a test split: this share of each class (fixed seed) is the test set
    "train_split": "train",
    "test_split": None,  # null: the first of test / val / validation present
}
#: the data spec keys of each folder source (only these datasets take them), with their defaults
SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "imagefolder": dict(_IMAGE_SOURCE_DEFAULTS),
    "hf_disk": {**_IMAGE_SOURCE_DEFAULTS, "image_column": "image", "label_column": "label"},
}
assert set(SOURCE_DEFAULTS) == set(FOLDER_SOURCES)


def _name(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def _int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


#: folder source key -> (test of a value, what is allowed); shared by this module and the config check
SOURCE_RULES: dict[str, tuple[Any, str]] = {
    "path": (_name, "the folder holding the data"),
    "image_size": (lambda x: _int(x) and x >= 1, "an integer >= 1 (pixels of the square images)"),
    "channels": (lambda x: _int(x) and x in (1, 3), "1 (grayscale) or 3 (RGB)"),
    "test_fraction": (
        lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1,
        "a fraction in (0, 1): the share of each class held out as the test set when the data has no test split",
    ),
    "train_split": (_name, "the name of the training split"),
    "test_split": (
        lambda x: x is None or _name(x),
        "null (test / val / validation when present, else dataset.test_fraction) or the name of the test split",
    ),
    "image_column": (_name, "the name of the column holding the images"),
    "label_column": (_name, "the name of the column holding the labels"),
}


def source_field_problem(key: str, value: Any) -> str | None:
    """What is allowed for folder source key ``key`` when ``value`` is not (None: it is)."""
    ok, allowed = SOURCE_RULES[key]
    return None if ok(value) else allowed


def _check_bool(field: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{field} must be a boolean, got {value!r}")


def check_data_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate a data spec and return a new dict with defaults filled in.

    Raises ValueError naming the offending field (``dataset.name``,
    ``partition.scheme``, ...) for unknown datasets/schemes, bad values, missing
    required keys or unknown keys.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"data spec must be a dict, got {type(spec).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in spec]
    if missing:
        raise ValueError(f"data spec: missing required key(s) {missing}")
    source = SOURCE_DEFAULTS.get(spec["name"], {}) if isinstance(spec["name"], str) else {}
    unknown = sorted(set(spec) - set(_REQUIRED_KEYS) - set(DATA_SPEC_DEFAULTS) - set(source))
    if unknown:
        raise ValueError(
            f"data spec: unknown key(s) {unknown}; allowed: "
            f"{sorted(set(_REQUIRED_KEYS) | set(DATA_SPEC_DEFAULTS) | set(source))}"
        )
    out = {**DATA_SPEC_DEFAULTS, **source, **spec}
    if out["name"] not in EXTERNAL_DATASETS and not source:
        image_info(out["name"])
    for key in source:
        problem = source_field_problem(key, out[key])
        if problem is not None:
            raise ValueError(f"dataset.{key} must be {problem}, got {out[key]!r}")
    if source:
        out["image_size"], out["channels"] = int(out["image_size"]), int(out["channels"])
        out["test_fraction"] = float(out["test_fraction"])
    if out["scheme"] not in PARTITION_SCHEMES:
        raise ValueError(
            f"partition.scheme: unknown scheme {out['scheme']!r}; allowed values: {list(PARTITION_SCHEMES)}"
        )
    if out["class_assignment"] not in CLASS_ASSIGNMENTS:
        raise ValueError(
            f"partition.class_assignment: unknown value {out['class_assignment']!r}; "
            f"allowed values: {list(CLASS_ASSIGNMENTS)}"
        )
    out["num_partitions"] = check_int("partition.num_partitions", out["num_partitions"], 1)
    out["classes_per_partition"] = check_int("partition.classes_per_partition", out["classes_per_partition"], 1)
    out["seed"] = check_int("partition.seed", out["seed"], 0)
    out["max_train_examples"] = check_int("dataset.max_train_examples", out["max_train_examples"], 0)
    out["max_test_examples"] = check_int("dataset.max_test_examples", out["max_test_examples"], 0)
    out["min_partition_size"] = check_int("partition.min_partition_size", out["min_partition_size"], 0)
    try:
        alpha = float(out["alpha"])
    except (TypeError, ValueError):
        raise ValueError(f"partition.alpha must be a number, got {out['alpha']!r}") from None
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"partition.alpha must be a finite number > 0, got {alpha}")
    out["alpha"] = alpha
    try:
        holdout = float(out["holdout"])
    except (TypeError, ValueError):
        raise ValueError(f"evaluation.holdout must be a number, got {out['holdout']!r}") from None
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"evaluation.holdout must be a fraction in [0, 1), got {holdout}")
    out["holdout"] = holdout
    out["augment"] = _check_bool("dataset.augment", out["augment"])
    out["download"] = _check_bool("dataset.download", out["download"])
    return out


def make_data_spec(name: str, num_partitions: int, **kwargs: Any) -> dict[str, Any]:
    """Build a complete, validated data spec (see the module docstring for keys)."""
    return check_data_spec({"name": name, "num_partitions": num_partitions, **kwargs})


def check_partition_id(partition_id: Any, num_partitions: int) -> int:
    if isinstance(partition_id, bool) or not isinstance(partition_id, (int, np.integer)):
        raise ValueError(f"partition-id must be an integer, got {partition_id!r}")
    pid = int(partition_id)
    if not 0 <= pid < num_partitions:
        raise ValueError(
            f"partition-id {pid} out of range: the data spec has "
            f"num_partitions={num_partitions} (valid ids 0..{num_partitions - 1})"
        )
    return pid


def check_client_split(split: Any) -> str:
    if split not in CLIENT_SPLITS:
        raise ValueError(f"split: unknown split {split!r}; allowed values: {list(CLIENT_SPLITS)}")
    return str(split)
