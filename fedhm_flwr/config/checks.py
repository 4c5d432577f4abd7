"""The config check's field rules and the sections every method shares (levels, data source,
training, evaluation, simulation, failures, robust aggregation, DP, tracking).

Torch-free (the launcher checks a config before importing torch): this module imports the data
catalog and specs only. The rules (:func:`require`, :func:`choice`, :func:`int_at_least`,
:func:`num_in`) are public: every method's own validation uses them.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.core import attack_kinds
from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.core.protocol import WIRE_DTYPES  # float32 | float16 | bfloat16 (wire.dtype)
from fedhm_flwr.data.catalog import DATASETS, EXTERNAL_DATASETS, FOLDER_SOURCES
from fedhm_flwr.data.spec import DATA_SPEC_DEFAULTS, SOURCE_DEFAULTS, source_field_problem

PARTITION_SCHEMES = ("iid", "dirichlet", "pathological")
ASSIGNMENTS = ("fixed", "dynamic")
#: heterofl / fedrolex widths: as given, or matched to FedHM's level on parameters, MACs or training memory
LEVEL_MATCH = ("none", "fedhm_params", "fedhm_macs", "fedhm_memory")
LR_SCHEDULES = ("constant", "cosine", "step")
BN_STATS = ("test_batch", "federated")
EVALUATION_WHERE = ("server", "clients", "both")
RAY_ADDRESS = re.compile(r"auto|[A-Za-z0-9][A-Za-z0-9.-]*:[0-9]{1,5}")  # simulation.ray_address (not null)
ATTACKS = attack_kinds.KINDS
ROBUST = ("none", "clip", "median", "trimmed_mean", "krum")


# --------------------------------------------------------------------------- field rules


def require(ok: object, field: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` (``field``, ``value``, what is ``allowed``) unless ``ok`` (is true)."""
    if not ok:
        raise ConfigError(field, value, allowed)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def choice(cfg: DictConfig, field: str, allowed: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, field)
    allowed = tuple(allowed)
    require(value in allowed, field, value, f"one of {list(allowed)}")


def flags(cfg: DictConfig, *fields: str) -> None:
    """Each field must be a boolean."""
    for field in fields:
        value = OmegaConf.select(cfg, field)
        require(isinstance(value, bool), field, value, "true or false")


def int_at_least(cfg: DictConfig, field: str, low: int) -> None:
    value = OmegaConf.select(cfg, field)
    require(is_int(value) and value >= low, field, value, f"an integer >= {low}")


def num_in(
    cfg: DictConfig, field: str, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    value = OmegaConf.select(cfg, field)
    ok = is_num(value) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    require(ok, field, value, f"a number in {lo}{low}, {high}{hi}")


def _validate_levels(cfg: DictConfig) -> None:
    ratios = OmegaConf.select(cfg, "levels.ratios")
    ratios = list(ratios) if OmegaConf.is_list(ratios) else ratios
    require(
        isinstance(ratios, list) and len(ratios) > 0,
        "levels.ratios",
        ratios,
        "a non-empty list of numbers in (0, 1], largest first",
    )
    for r in ratios:
        require(
            is_num(r) and 0 < r <= 1, "levels.ratios", ratios, "a non-empty list of numbers in (0, 1], largest first"
        )
    require(
        all(a > b for a, b in itertools.pairwise(ratios)),
        "levels.ratios",
        ratios,
        "distinct levels listed largest first, e.g. [1, 0.5, 0.25, 0.125]",
    )
    props = OmegaConf.select(cfg, "levels.proportions")
    if props is None:  # equal shares
        props = [1] * len(ratios)
    props = list(props) if OmegaConf.is_list(props) else props
    require(
        isinstance(props, list)
        and len(props) == len(ratios)
        and all(is_num(p) and p >= 0 for p in props)
        and sum(props) > 0,
        "levels.proportions",
        props,
        f"null (equal shares) or {len(ratios)} non-negative numbers (one per level) with a positive sum",
    )
    choice(cfg, "levels.assignment", ASSIGNMENTS)
    choice(cfg, "levels.match", LEVEL_MATCH)
    default = OmegaConf.select(cfg, "levels.default")
    require(default is None or default in ratios, "levels.default", default, f"null or one of levels.ratios {ratios}")


def _validate_source(cfg: DictConfig) -> None:
    """A folder source's options (``dataset.path``, ``dataset.image_size``, ...): the data spec's rules."""
    if cfg.dataset.name not in SOURCE_DEFAULTS:
        return
    for key, default in SOURCE_DEFAULTS[cfg.dataset.name].items():
        value = cfg.dataset.get(key, default)
        problem = source_field_problem(key, value)
        require(problem is None, f"dataset.{key}", value, str(problem))
    data_dir = cfg.dataset.get("data_dir")
    require(data_dir is None, "dataset.data_dir", data_dir, "null: dataset.path says where the data is")


def _validate_partition_count(cfg: DictConfig) -> None:
    """``num_clients`` partitions must fit the training examples of a built-in dataset (its size, or
    ``dataset.max_train_examples`` when smaller): every client needs at least one example, and a
    Dirichlet partition at least ``min_partition_size`` (2), else every simulated client would fail
    in turn. A folder source or text corpus is counted when read (the data check)."""
    info = DATASETS.get(str(cfg.dataset.name))
    if info is None:
        return
    limit = int(cfg.dataset.max_train_examples)
    examples = min(info.num_train, limit) if limit > 0 else info.num_train
    source = (
        f"dataset.max_train_examples={limit}"
        if 0 < limit < info.num_train
        else f"dataset.name={cfg.dataset.name} has {info.num_train:,}"
    )
    each = int(DATA_SPEC_DEFAULTS["min_partition_size"]) if cfg.partition.scheme == "dirichlet" else 1
    why = (
        f"partition.scheme=dirichlet gives every client at least {each} examples"
        if each > 1
        else "every client needs at least one"
    )
    fix = "lower num_clients" + (" or raise dataset.max_train_examples" if examples < info.num_train else "")
    require(
        int(cfg.num_clients) * each <= examples,
        "num_clients",
        cfg.num_clients,
        f"an integer <= {examples // each:,}: {source} training examples and {why} ({fix})",
    )


def validate_common(cfg: DictConfig, robust: tuple[str, ...]) -> None:
    """The sections every method shares, after the method and model checks (the first invalid value
    raises); ``robust``: the ``aggregation.robust`` values the method accepts."""
    width = OmegaConf.select(cfg, "model.width")
    require(
        width is None or (is_int(width) and width >= 1),
        "model.width",
        width,
        "null (the architecture's default) or an integer >= 1",
    )
    choice(cfg, "dataset.name", [*DATASETS, *EXTERNAL_DATASETS, *FOLDER_SOURCES])
    _validate_source(cfg)
    for field in ("dataset.max_train_examples", "dataset.max_test_examples"):
        int_at_least(cfg, field, 0)
    int_at_least(cfg, "seed", 0)
    int_at_least(cfg, "rounds", 1)
    int_at_least(cfg, "num_clients", 1)
    num_in(cfg, "fraction_train", 0.0, 1.0, low_open=True)
    int_at_least(cfg, "min_train_nodes", 1)
    num_in(cfg, "timeout", 0.0, math.inf, low_open=True)
    num_in(cfg, "stragglers.quorum", 0.0, 1.0, low_open=True)
    num_in(cfg, "stragglers.factor", 1.0, math.inf)
    num_in(cfg, "stragglers.min_seconds", 0.0, math.inf, high_open=True)
    int_at_least(cfg, "availability.min_nodes", 0)
    num_in(cfg, "availability.wait_seconds", 0.0, math.inf, high_open=True)
    choice(cfg, "availability.on_timeout", ("continue", "stop"))
    num_in(cfg, "availability.poll_seconds", 0.0, math.inf, low_open=True, high_open=True)
    choice(cfg, "availability.query", ("all", "sampled"))
    choice(cfg, "wire.dtype", WIRE_DTYPES)
    _validate_levels(cfg)
    choice(cfg, "partition.scheme", PARTITION_SCHEMES)
    num_in(cfg, "partition.alpha", 0.0, math.inf, low_open=True, high_open=True)
    int_at_least(cfg, "partition.classes_per_partition", 1)
    _validate_partition_count(cfg)
    int_at_least(cfg, "train.local_epochs", 1)
    int_at_least(cfg, "train.batch_size", 1)
    num_in(cfg, "train.lr", 0.0, math.inf, low_open=True, high_open=True)
    choice(cfg, "train.lr_schedule", LR_SCHEDULES)
    num_in(cfg, "train.lr_gamma", 0.0, 1.0, low_open=True)
    steps = OmegaConf.select(cfg, "train.lr_step_rounds")
    require(
        OmegaConf.is_list(steps) and all(is_num(s) and 0 < s < 1 for s in steps),
        "train.lr_step_rounds",
        steps,
        "a list of fractions of the run in (0, 1)",
    )
    num_in(cfg, "train.momentum", 0.0, 1.0, high_open=True)
    num_in(cfg, "train.weight_decay", 0.0, math.inf, high_open=True)
    num_in(cfg, "train.grad_clip", 0.0, math.inf, high_open=True)
    masked = OmegaConf.select(cfg, "train.masked_ce")
    require(isinstance(masked, bool), "train.masked_ce", masked, "true or false")
    flags(cfg, "train.distill.enabled")
    num_in(cfg, "train.distill.temperature", 0.0, math.inf, low_open=True, high_open=True)
    num_in(cfg, "train.distill.weight", 0.0, math.inf, high_open=True)
    int_at_least(cfg, "evaluation.every", 1)
    int_at_least(cfg, "evaluation.batch_size", 1)
    choice(cfg, "evaluation.bn_stats", BN_STATS)
    int_at_least(cfg, "evaluation.bn_clients", 0)
    int_at_least(cfg, "evaluation.bn_examples", 0)
    flags(cfg, "evaluation.deploy_stats", "evaluation.levels")
    choice(cfg, "evaluation.where", EVALUATION_WHERE)
    num_in(cfg, "evaluation.holdout", 0.0, 1.0, high_open=True)
    require(
        cfg.evaluation.where == "server" or cfg.evaluation.holdout > 0,
        "evaluation.holdout",
        cfg.evaluation.holdout,
        f"a fraction in (0, 1) when evaluation.where={cfg.evaluation.where}",
    )
    num_in(cfg, "simulation.num_cpus", 0.0, math.inf, low_open=True, high_open=True)
    num_in(cfg, "simulation.num_gpus", 0.0, math.inf, high_open=True)
    ray_address = OmegaConf.select(cfg, "simulation.ray_address")
    require(
        ray_address is None or (isinstance(ray_address, str) and RAY_ADDRESS.fullmatch(ray_address) is not None),
        "simulation.ray_address",
        ray_address,
        "null (a private Ray instance), auto (the cluster this machine belongs to) or HOST:PORT of a Ray "
        "cluster's head (its GCS port, 6379 by default)",
    )
    int_at_least(cfg, "checkpoint.every", 0)
    flags(cfg, "checkpoint.keep_best")
    num_in(cfg, "failures.crash_probability", 0.0, 1.0)
    num_in(cfg, "failures.slow_probability", 0.0, 1.0)
    num_in(cfg, "failures.slow_seconds", 0.0, math.inf, high_open=True)
    _validate_untrusted(cfg, robust)
    _validate_tracking(cfg)
    out = OmegaConf.select(cfg, "output_dir")
    require(
        out is None or (isinstance(out, str) and Path(out).is_absolute()), "output_dir", out, "null or an absolute path"
    )


def _validate_untrusted(cfg: DictConfig, modes: tuple[str, ...]) -> None:
    """``failures.attack``, ``aggregation`` and ``dp``; ``modes``: the ``aggregation.robust`` values the
    method accepts (:func:`fedhm_flwr.config.methods.robust_modes`)."""
    choice(cfg, "failures.attack.kind", ATTACKS)
    num_in(cfg, "failures.attack.fraction", 0.0, 1.0)
    choice(cfg, "failures.attack.malformed", ("random", *attack_kinds.MALFORMED_KINDS))
    num_in(cfg, "failures.attack.scale", -math.inf, math.inf, low_open=True, high_open=True)
    mode = OmegaConf.select(cfg, "aggregation.robust")
    require(
        mode in modes,
        "aggregation.robust",
        mode,
        f"one of {list(modes)} for method={cfg.method.name}"
        + (" (krum needs replies that cover the whole model)" if mode == "krum" else ""),
    )
    num_in(cfg, "aggregation.clip_norm", 0.0, math.inf, high_open=True)
    num_in(cfg, "aggregation.clip_quantile", 0.0, 1.0, low_open=True)
    num_in(cfg, "aggregation.trim_fraction", 0.0, 0.5, high_open=True)
    num_in(cfg, "aggregation.krum_fraction", 0.0, 0.5, high_open=True)
    int_at_least(cfg, "aggregation.krum_m", 1)
    num_in(cfg, "aggregation.outlier_z", 0.0, math.inf, high_open=True)
    num_in(cfg, "aggregation.max_norm", 0.0, 1e15, low_open=True)  # bound² stays far below float32's max
    examples = OmegaConf.select(cfg, "aggregation.max_examples")
    require(
        examples is None or (is_int(examples) and examples >= 1),
        "aggregation.max_examples",
        examples,
        "null (the training set's size when known) or an integer >= 1",
    )
    dp_seed = OmegaConf.select(cfg, "dp.seed")
    require(
        dp_seed is None or (isinstance(dp_seed, int) and not isinstance(dp_seed, bool) and dp_seed >= 0),
        "dp.seed",
        dp_seed,
        "null (OS entropy: the private setting) or an integer >= 0 (reproducible, not private)",
    )
    enabled = OmegaConf.select(cfg, "dp.enabled")
    require(isinstance(enabled, bool), "dp.enabled", enabled, "true or false")
    num_in(cfg, "dp.clip", 0.0, math.inf, low_open=True, high_open=True)
    num_in(cfg, "dp.noise_multiplier", 0.0, math.inf, low_open=True, high_open=True)
    num_in(cfg, "dp.delta", 0.0, 1.0, low_open=True, high_open=True)
    if enabled:
        require(
            "krum" in modes,
            "dp.enabled",
            enabled,
            f"false for method={cfg.method.name} (DP needs replies that cover the whole model: "
            "fedhm, fedlora, fedavg with variant=full or family=fedhm)",
        )
        require(
            mode == "none" and float(cfg.aggregation.outlier_z) == 0,
            "aggregation.robust",
            mode,
            "none, with aggregation.outlier_z=0, when dp.enabled (DP clips itself; a data-dependent "
            "filter is outside the accountant)",
        )


def _validate_tracking(cfg: DictConfig) -> None:
    """``tracking.*``."""
    flags(cfg, "tracking.tensorboard", "tracking.mlflow")
    uri = OmegaConf.select(cfg, "tracking.mlflow_uri")
    require(
        uri is None or (isinstance(uri, str) and uri != ""),
        "tracking.mlflow_uri",
        uri,
        "null (a file store in <run dir>/mlruns) or an MLflow tracking URI",
    )
    if OmegaConf.select(cfg, "tracking.mlflow"):  # refused before the run starts, not after round 1
        require(
            importlib.util.find_spec("mlflow") is not None,
            "tracking.mlflow",
            True,
            "false, or true with MLflow installed: pip install 'fedhm-flwr[mlflow]'",
        )
