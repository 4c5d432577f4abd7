"""A run's options, parsed once: :class:`RunOptions`, a tree of frozen pydantic dataclasses of the
sections the server reads, and :func:`run_options`, which builds it from a config, refusing the first
bad value (:func:`~fedhm_flwr.config.options.declare.parse`).

``conf/config.yaml``'s own keys are declared once, here (the top level) and in
:mod:`~fedhm_flwr.config.options.sections` (its sections): type, default, allowed values, meaning.
The YAML holds the same defaults for users to read (``tests/test_declarations.py``). A missing key
takes its declared default; a key that is not a field of its section is refused. The ``model`` and
``dataset`` groups differ per model and data source (and ``model.kwargs`` is the user's): only what the
server needs of them is taken (:class:`ModelOptions`, :class:`DatasetOptions`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass as plain_dataclass
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationInfo, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Self

from fedhm_flwr.config.options.base import OPTIONS, MethodOptions
from fedhm_flwr.config.options.declare import DECLARED, Int, Num, Text, option, parse
from fedhm_flwr.config.options.sections import (
    DP,
    Aggregation,
    Availability,
    Checkpoint,
    Distill,
    Evaluation,
    Failures,
    Levels,
    Partition,
    Simulation,
    Stragglers,
    Tracking,
    Train,
    Wire,
    absolute_dir,
)
from fedhm_flwr.config.specs import backbone_choice, data_spec, schedule
from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.data.catalog import DATASETS
from fedhm_flwr.data.spec import DATA_SPEC_DEFAULTS

__all__ = [  # the sections re-exported: their readers import them from here, with RunOptions
    "DP",
    "Aggregation",
    "Availability",
    "Checkpoint",
    "DatasetOptions",
    "Distill",
    "Evaluation",
    "Failures",
    "Levels",
    "ModelOptions",
    "Partition",
    "RunOptions",
    "Simulation",
    "Stragglers",
    "Tracking",
    "Train",
    "Wire",
    "run_options",
]


@plain_dataclass(frozen=True)
class ModelOptions:
    """What the server reads of the ``model`` group: the architecture, the backbone as used
    (:func:`~fedhm_flwr.config.specs.backbone_choice`), a transformer's sizes (None: the
    architecture's default) and a user's model (``target``, its factory's ``kwargs``; ``arch`` custom)."""

    arch: str
    backbone: str
    backbone_seed: int
    width: int | None = None
    depth: int | None = None
    heads: int | None = None
    intermediate: int | None = None
    patch: int | None = None
    mlp_ratio: int | None = None
    target: str | None = None
    kwargs: dict[str, Any] | None = None


@plain_dataclass(frozen=True)
class DatasetOptions:
    """What the server reads of the ``dataset`` group."""

    name: str
    max_train_examples: int
    data_dir: str | None = None


@dataclass(frozen=True, config=DECLARED, kw_only=True)
class RunOptions:
    """The run's options as the server reads them (see the module docstring): ``conf/config.yaml``'s own
    keys declared here and in :mod:`~fedhm_flwr.config.options.sections`; ``data`` is the data spec
    every message carries (:func:`~fedhm_flwr.config.specs.data_spec`, ``num_clients`` partitions),
    ``method`` the method's typed ``method`` group."""

    seed: Int = option(0, "the run's seed (data partition, sampling, initial model)", ge=0)
    rounds: Int = option(10, "server rounds", ge=1)
    num_clients: Int = option(20, "simulated SuperNodes (= data partitions) in simulation", ge=1)
    fraction_train: Num = option(0.5, "fraction of connected nodes sampled per round", gt=0.0, le=1.0)
    min_train_nodes: Int = option(2, "the fewest nodes a round trains", ge=1)
    timeout: Num = option(600.0, "seconds the server waits for one round's replies, at most", gt=0.0, le=math.inf)
    stragglers: Stragglers = option(Stragglers(), "when a round stops waiting before timeout")
    availability: Availability = option(Availability(), "rounds with too few connected nodes")
    wire: Wire = option(Wire(), "the arrays on the wire")
    levels: Levels = option(Levels(), "the method's levels")
    partition: Partition = option(Partition(), "how the data is split among clients")
    train: Train = option(Train(), "local training")
    evaluation: Evaluation = option(Evaluation(), "evaluation")
    simulation: Simulation = option(Simulation(), "simulated clients' resources")
    checkpoint: Checkpoint = option(Checkpoint(), "checkpoints")
    failures: Failures = option(Failures(), "failure injection")
    aggregation: Aggregation = option(Aggregation(), "defences on the merged updates")
    dp: DP = option(DP(), "client-level differential privacy")
    tracking: Tracking = option(Tracking(), "TensorBoard and MLflow")
    output_dir: Text | None = option(
        None, "absolute run directory (default: chosen by the entry point)", allowed="null or an absolute path"
    )
    method: MethodOptions
    model: ModelOptions
    dataset: DatasetOptions
    data: dict[str, Any]

    @model_validator(mode="after")
    def _across(self, info: ValidationInfo) -> Self:
        """The rules across sections, where a config is parsed (:func:`run_options`: its plain values
        are the context); ``dataclasses.replace`` of parsed options does not run them again."""
        if not info.context:
            return self
        if not absolute_dir(self.output_dir):
            raise ConfigError("output_dir", self.output_dir, "null or an absolute path")
        _check_partition_count(self, info.context["dataset"])
        _check_untrusted(self)
        if self.tracking.mlflow and importlib.util.find_spec("mlflow") is None:  # refused before the run starts
            raise ConfigError(
                "tracking.mlflow", True, "false, or true with MLflow installed: pip install 'fedhm-flwr[mlflow]'"
            )
        return self

    def data_spec(self, num_partitions: int | None = None) -> dict[str, Any]:
        """The data spec of a node among ``num_partitions`` partitions (None: ``num_clients``)."""
        if num_partitions is None:
            return dict(self.data)
        return {**self.data, "num_partitions": int(num_partitions)}

    def lr_schedule(self) -> Callable[[int], float]:
        """The round's learning rate (rounds start at 1) under ``train.lr_schedule``
        (:func:`~fedhm_flwr.config.specs.schedule`)."""
        t = self.train
        return schedule(t.lr, self.rounds, t.lr_schedule, t.lr_step_rounds, t.lr_gamma)


#: the config's own sections that :class:`RunOptions` does not parse whole (see the module docstring)
OPEN_SECTIONS = ("method", "model", "dataset")
#: fields of :class:`RunOptions` derived here, not keys of the config
DERIVED = ("data",)


def run_options(cfg: DictConfig) -> RunOptions:
    """The typed options of the config ``cfg``: every section parsed against its declaration, the
    rules across sections applied (a key no section knows, a bad value: :class:`ConfigError`)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    sections = {k: v for k, v in plain.items() if k not in OPEN_SECTIONS}
    model, dataset = plain["model"], plain["dataset"]
    sections["method"] = OPTIONS[str(plain["method"]["name"])].parse(plain["method"])
    sections["model"] = ModelOptions(
        arch=str(model["arch"]),
        backbone=backbone_choice(cfg),
        backbone_seed=int(model.get("backbone_seed") or 0),
        **{
            k: model.get(k)
            for k in ("width", "depth", "heads", "intermediate", "patch", "mlp_ratio", "target", "kwargs")
        },
    )
    sections["dataset"] = DatasetOptions(
        str(dataset["name"]), int(dataset["max_train_examples"]), dataset.get("data_dir")
    )
    for key in DERIVED:
        if key in plain:
            raise ConfigError(key, plain.get(key), f"no such key: {key} is derived from the config")
    opts = parse(RunOptions, {**sections, "data": {}}, "", context=cast("dict[str, Any]", plain))
    return dataclasses.replace(opts, data=data_spec(cfg))  # derived from the values just checked


def _check_partition_count(opts: RunOptions, dataset: dict[str, Any]) -> None:
    """``num_clients`` partitions must fit the training examples of a built-in dataset (its size, or
    ``dataset.max_train_examples`` when smaller): every client needs at least one example, and a
    Dirichlet partition at least ``min_partition_size`` (2), else every simulated client would fail
    in turn. A folder source or text corpus is counted when read (the data check)."""
    info = DATASETS.get(str(dataset["name"]))
    if info is None:
        return
    limit = int(dataset["max_train_examples"])
    examples = min(info.num_train, limit) if limit > 0 else info.num_train
    source = (
        f"dataset.max_train_examples={limit}"
        if 0 < limit < info.num_train
        else f"dataset.name={dataset['name']} has {info.num_train:,}"
    )
    each = int(DATA_SPEC_DEFAULTS["min_partition_size"]) if opts.partition.scheme == "dirichlet" else 1
    why = (
        f"partition.scheme=dirichlet gives every client at least {each} examples"
        if each > 1
        else "every client needs at least one"
    )
    fix = "lower num_clients" + (" or raise dataset.max_train_examples" if examples < info.num_train else "")
    if opts.num_clients * each > examples:
        raise ConfigError(
            "num_clients",
            opts.num_clients,
            f"an integer <= {examples // each:,}: {source} training examples and {why} ({fix})",
        )


def _check_untrusted(opts: RunOptions) -> None:
    """``aggregation.robust`` and ``dp.enabled`` against what the method's merge allows
    (:meth:`~fedhm_flwr.config.options.base.MethodOptions.robust_modes`)."""
    modes, name, mode = opts.method.robust_modes(), opts.method.name, opts.aggregation.robust
    if mode not in modes:
        raise ConfigError(
            "aggregation.robust",
            mode,
            f"one of {list(modes)} for method={name}"
            + (" (krum needs replies that cover the whole model)" if mode == "krum" else ""),
        )
    if opts.dp.enabled:
        if "krum" not in modes:
            raise ConfigError(
                "dp.enabled",
                True,
                f"false for method={name} (DP needs replies that cover the whole model: "
                "fedhm, fedlora, fedavg with variant=full or family=fedhm)",
            )
        if mode != "none" or opts.aggregation.outlier_z != 0:
            raise ConfigError(
                "aggregation.robust",
                mode,
                "none, with aggregation.outlier_z=0, when dp.enabled (DP clips itself; a data-dependent "
                "filter is outside the accountant)",
            )
