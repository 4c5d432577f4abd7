"""A run's options, parsed once: :class:`RunOptions`, a tree of frozen dataclasses of the sections the
server reads, and :func:`run_options`, which builds it from a validated config.

The fields name the keys of ``conf/config.yaml`` (where their defaults and their meaning are written,
once); the checks of :mod:`fedhm_flwr.config.checks` say which values each accepts. A resumed run's
saved config gets today's defaults for the keys added since (:func:`fedhm_flwr.config.resume_config`)
before it is parsed, so every field is set and nothing downstream reads a key with a fallback. A key
that is not a field of its section is refused (:func:`~fedhm_flwr.config.options.base.parse_options`).
The ``model`` and ``dataset`` groups differ per model and data source (and ``model.kwargs`` is the
user's): only what the server needs of them is taken (:class:`ModelOptions`, :class:`DatasetOptions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import require
from fedhm_flwr.config.options.base import OPTIONS, MethodOptions, parse_options
from fedhm_flwr.config.specs import backbone_choice, data_spec, schedule


@dataclass(frozen=True)
class Stragglers:
    quorum: float
    factor: float
    min_seconds: float


@dataclass(frozen=True)
class Availability:
    min_nodes: int
    wait_seconds: float
    on_timeout: str
    poll_seconds: float
    query: str


@dataclass(frozen=True)
class Wire:
    dtype: str


@dataclass(frozen=True)
class Levels:
    ratios: tuple[float, ...]
    proportions: tuple[float, ...] | None
    assignment: str
    default: float | None
    match: str

    @property
    def shares(self) -> list[float]:
        """The levels' shares of clients (``proportions``; null: equal shares)."""
        return [1.0] * len(self.ratios) if self.proportions is None else list(self.proportions)


@dataclass(frozen=True)
class Partition:
    scheme: str
    alpha: float
    classes_per_partition: int


@dataclass(frozen=True)
class Distill:
    enabled: bool
    temperature: float
    weight: float


@dataclass(frozen=True)
class Train:
    local_epochs: int
    batch_size: int
    lr: float
    lr_schedule: str
    lr_step_rounds: tuple[float, ...]
    lr_gamma: float
    momentum: float
    weight_decay: float
    masked_ce: bool
    grad_clip: float
    distill: Distill


@dataclass(frozen=True)
class Evaluation:
    every: int
    batch_size: int
    bn_stats: str
    bn_clients: int
    bn_examples: int
    deploy_stats: bool
    levels: bool
    where: str
    holdout: float


@dataclass(frozen=True)
class Simulation:
    num_cpus: float
    num_gpus: float
    ray_address: str | None


@dataclass(frozen=True)
class Checkpoint:
    every: int
    keep_best: bool


@dataclass(frozen=True)
class Attack:
    kind: str
    fraction: float
    scale: float
    malformed: str


@dataclass(frozen=True)
class Failures:
    crash_probability: float
    slow_probability: float
    slow_seconds: float
    attack: Attack


@dataclass(frozen=True)
class Aggregation:
    robust: str
    clip_norm: float
    clip_quantile: float
    trim_fraction: float
    krum_fraction: float
    krum_m: int
    outlier_z: float
    max_norm: float
    max_examples: int | None


@dataclass(frozen=True)
class DP:
    enabled: bool
    clip: float
    noise_multiplier: float
    delta: float
    seed: int | None


@dataclass(frozen=True)
class Tracking:
    tensorboard: bool
    mlflow: bool
    mlflow_uri: str | None
    experiment: str


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class DatasetOptions:
    """What the server reads of the ``dataset`` group."""

    name: str
    max_train_examples: int
    data_dir: str | None = None


@dataclass(frozen=True)
class RunOptions:
    """The run's options as the server reads them (see the module docstring); ``data`` is the data
    spec every message carries (:func:`~fedhm_flwr.config.specs.data_spec`, ``num_clients``
    partitions), ``method`` the method's typed ``method`` group."""

    seed: int
    rounds: int
    num_clients: int
    fraction_train: float
    min_train_nodes: int
    timeout: float
    stragglers: Stragglers
    availability: Availability
    wire: Wire
    levels: Levels
    partition: Partition
    train: Train
    evaluation: Evaluation
    simulation: Simulation
    checkpoint: Checkpoint
    failures: Failures
    aggregation: Aggregation
    dp: DP
    tracking: Tracking
    output_dir: str | None
    method: MethodOptions
    model: ModelOptions
    dataset: DatasetOptions
    data: dict[str, Any]

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
    """The typed options of the validated config ``cfg`` (a key no section knows: :class:`ConfigError`)."""
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
        require(key not in plain, key, plain.get(key), f"no such key: {key} is derived from the config")
    sections["data"] = data_spec(cfg)
    return parse_options(RunOptions, sections, "")
