"""The declarations of the config's shared sections (``conf/config.yaml``'s own keys): each option
once, with its type, default, allowed values and meaning (:func:`~fedhm_flwr.config.options.declare.option`);
``conf/config.yaml`` holds the same defaults for users to read and override
(``tests/test_declarations.py`` checks they are equal). The rules within a section are its
validators; the rules across sections are :class:`~fedhm_flwr.config.options.run.RunOptions`'.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Annotated

from pydantic import model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Self

from fedhm_flwr.config.options.declare import DECLARED, Flag, Int, Num, OneOf, Refused, Text, option
from fedhm_flwr.core import attack_kinds
from fedhm_flwr.core.protocol import WIRE_DTYPES  # float32 | float16 | bfloat16 (wire.dtype)

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


_RAY = (
    "null (a private Ray instance), auto (the cluster this machine belongs to) or HOST:PORT of a Ray "
    "cluster's head (its GCS port, 6379 by default)"
)
_RATIOS = "a non-empty list of numbers in (0, 1], largest first"


@dataclass(frozen=True, config=DECLARED)
class Stragglers:
    """A round stops waiting before ``timeout`` once most nodes answered (docs/ROBUSTNESS.md)."""

    quorum: Num = option(0.5, "once this fraction of the sampled nodes answered ...", gt=0.0, le=1.0)
    factor: Num = option(
        4.0, "... wait until factor x the median time of the answers so far (inf: until timeout)", ge=1.0, le=math.inf
    )
    min_seconds: Num = option(
        30.0, "but never stop waiting sooner than this after the messages went out", ge=0.0, lt=math.inf
    )
    verdict_seconds: Num = option(
        62.0,
        "how long the run's end waits for the SuperLink's verdict on devices still late after the final round "
        "(62: Flower's heartbeat window and a margin; one reported unavailable, its SuperNode lost, is a failure "
        "of its round, not late); on devices only, rounds never wait; 0: one pull",
        ge=0.0,
        le=600.0,
    )


@dataclass(frozen=True, config=DECLARED)
class Availability:
    """Rounds with too few connected nodes (real devices come and go)."""

    min_nodes: Int = option(0, "a round waits until this many nodes are connected (0: min_train_nodes)", ge=0)
    wait_seconds: Num = option(300.0, "for at most this long, logging the wait", ge=0.0, lt=math.inf)
    on_timeout: Annotated[Text, OneOf(("continue", "stop"))] = option(
        "continue", "continue: go on with the nodes present; stop: end the run"
    )
    poll_seconds: Num = option(1.0, "how often the connected nodes are counted", gt=0.0, lt=math.inf)
    query: Annotated[Text, OneOf(("all", "sampled"))] = option(
        "all", "node-info query: every node when it connects, or only the nodes a round samples"
    )


@dataclass(frozen=True, config=DECLARED)
class Wire:
    dtype: Annotated[Text, OneOf(WIRE_DTYPES)] = option("float32", "the arrays' dtype on the wire, both directions")


@dataclass(frozen=True, config=DECLARED)
class Levels:
    """The method's levels and how clients get one."""

    ratios: tuple[Num, ...] = option(
        (1.0, 0.5, 0.25, 0.125), "the method's levels, largest first (FedHM: rank ratio gamma)", allowed=_RATIOS
    )
    proportions: tuple[Num, ...] | None = option(
        None,
        "relative share of clients per level (null: equal shares)",
        allowed="null (equal shares) or one non-negative number per level with a positive sum",
    )
    assignment: Annotated[Text, OneOf(ASSIGNMENTS)] = option(
        "fixed", "fixed: one level per client for the run; dynamic: drawn per round"
    )
    default: Num | None = option(
        None, "level for nodes that declare nothing (null: the assignment rule)", allowed="null or one of levels.ratios"
    )
    match: Annotated[Text, OneOf(LEVEL_MATCH)] = option(
        "none", "heterofl/fedrolex: none (ratios are width rates) or the FedHM resource each width matches"
    )

    @property
    def shares(self) -> list[float]:
        """The levels' shares of clients (``proportions``; null: equal shares)."""
        return [1.0] * len(self.ratios) if self.proportions is None else list(self.proportions)

    @model_validator(mode="after")
    def _rules(self) -> Self:
        ratios = list(self.ratios)
        if not ratios or not all(0 < r <= 1 for r in ratios):
            raise Refused("ratios")
        if not all(a > b for a, b in itertools.pairwise(ratios)):
            raise Refused("ratios", "distinct levels listed largest first, e.g. [1, 0.5, 0.25, 0.125]")
        props = self.shares
        if not (len(props) == len(ratios) and all(p >= 0 for p in props) and sum(props) > 0):
            raise Refused(
                "proportions",
                f"null (equal shares) or {len(ratios)} non-negative numbers (one per level) with a positive sum",
            )
        if self.default is not None and self.default not in ratios:
            raise Refused("default", f"null or one of levels.ratios {ratios}")
        return self


@dataclass(frozen=True, config=DECLARED)
class Partition:
    scheme: Annotated[Text, OneOf(PARTITION_SCHEMES)] = option(
        "dirichlet", "how the training set is split among clients"
    )
    alpha: Num = option(0.5, "Dirichlet concentration (FedHM: 0.5 'IID', 0.1 non-IID)", gt=0.0, lt=math.inf)
    classes_per_partition: Int = option(2, "classes per client in the pathological split", ge=1)


@dataclass(frozen=True, config=DECLARED)
class Distill:
    """Self-distillation towards the received model (FedHM conference paper, non-IID)."""

    enabled: Flag = option(False, "distil towards the received model")
    temperature: Num = option(2.0, "T (the paper gives no value)", gt=0.0, lt=math.inf)
    weight: Num = option(0.5, "lambda: loss = CE + lambda * T^2 * KL(teacher_T || student_T)", ge=0.0, lt=math.inf)


@dataclass(frozen=True, config=DECLARED)
class Train:
    local_epochs: Int = option(1, "epochs of local training per round", ge=1)
    batch_size: Int = option(32, "local training batch size", ge=1)
    lr: Num = option(0.05, "client learning rate", gt=0.0, lt=math.inf)
    lr_schedule: Annotated[Text, OneOf(LR_SCHEDULES)] = option("constant", "the learning rate over rounds")
    lr_step_rounds: tuple[Num, ...] = option(
        (0.5, 0.75),
        "step schedule: fractions of the run where lr is multiplied by lr_gamma",
        allowed="a list of fractions of the run in (0, 1)",
    )
    lr_gamma: Num = option(0.1, "the step schedule's factor", gt=0.0, le=1.0)
    momentum: Num = option(0.9, "SGD momentum", ge=0.0, lt=1.0)
    weight_decay: Num = option(5.0e-4, "SGD weight decay", ge=0.0, lt=math.inf)
    masked_ce: Flag = option(True, "logits of classes absent from a client's data set to 0 in training")
    grad_clip: Num = option(
        0.0,
        "max gradient norm, 0 = off (a method.grad_clip, where a method has one, takes precedence)",
        ge=0.0,
        lt=math.inf,
    )
    distill: Distill = option(Distill(), "self-distillation towards the received model")

    @model_validator(mode="after")
    def _steps(self) -> Self:
        if not all(0 < s < 1 for s in self.lr_step_rounds):
            raise Refused("lr_step_rounds")
        return self


@dataclass(frozen=True, config=DECLARED)
class Evaluation:
    every: Int = option(1, "evaluate every N rounds (and always after the last)", ge=1)
    batch_size: Int = option(500, "evaluation batch size", ge=1)
    bn_stats: Annotated[Text, OneOf(BN_STATS)] = option(
        "test_batch", "test_batch: test-batch statistics; federated: clients' sums (sBN)"
    )
    bn_clients: Int = option(10, "how many clients the bn-stats query asks (0: all connected)", ge=0)
    bn_examples: Int = option(128, "the most training examples each asked client sums statistics over (0: all)", ge=0)
    deploy_stats: Flag = option(True, "after the last round, ask the clients for every level's fixed norm statistics")
    levels: Flag = option(True, "also evaluate each level's deployable model")
    where: Annotated[Text, OneOf(EVALUATION_WHERE)] = option(
        "server", "server's test set, the sampled nodes' held-out examples, or both"
    )
    holdout: Num = option(0.1, "fraction of each node's examples held out for client-side evaluation", ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _holdout(self) -> Self:
        if self.where != "server" and not self.holdout > 0:
            raise Refused("holdout", f"a fraction in (0, 1) when evaluation.where={self.where}")
        return self


@dataclass(frozen=True, config=DECLARED)
class Simulation:
    num_cpus: Num = option(1.0, "CPU cores per simulated client (also its torch threads)", gt=0.0, lt=math.inf)
    num_gpus: Num = option(0.0, "GPU share per simulated client", ge=0.0, lt=math.inf)
    ray_address: Text | None = option(
        None,
        "null: a private Ray instance; auto | HOST:PORT: an existing Ray cluster",
        allowed=_RAY,
    )

    @model_validator(mode="after")
    def _address(self) -> Self:
        if self.ray_address is not None and RAY_ADDRESS.fullmatch(self.ray_address) is None:
            raise Refused("ray_address")
        return self


@dataclass(frozen=True, config=DECLARED)
class Checkpoint:
    every: Int = option(1, "save the global model and strategy state every N rounds (0: only at the end)", ge=0)
    keep_best: Flag = option(False, "also keep the model of the best evaluated round")


@dataclass(frozen=True, config=DECLARED)
class Attack:
    """Malicious clients (a seeded, fixed set for the whole run)."""

    kind: Annotated[Text, OneOf(ATTACKS)] = option("none", "the attack")
    fraction: Num = option(0.0, "share of the nodes (partitions) that attack", ge=0.0, le=1.0)
    scale: Num = option(100.0, "scale: the update sent is scale x (trained - received)", gt=-math.inf, lt=math.inf)
    malformed: Annotated[Text, OneOf(("random", *attack_kinds.MALFORMED_KINDS))] = option(
        "random", "malformed: the class of malformed reply sent (random: one drawn per reply)"
    )


@dataclass(frozen=True, config=DECLARED)
class Failures:
    """Failure injection (seeded: the same clients fail in a repeated run)."""

    crash_probability: Num = option(0.0, "a sampled client raises instead of training", ge=0.0, le=1.0)
    slow_probability: Num = option(0.0, "a sampled client sleeps slow_seconds before replying", ge=0.0, le=1.0)
    slow_seconds: Num = option(0.0, "longer than timeout misses the round", ge=0.0, lt=math.inf)
    attack: Attack = option(Attack(), "malicious clients")


@dataclass(frozen=True, config=DECLARED)
class Aggregation:
    """Defences on the recovered full-shape updates (the method's allowed modes: a rule across sections)."""

    robust: Annotated[Text, OneOf(ROBUST)] = option("none", "the robust aggregation")
    clip_norm: Num = option(
        0.0, "clip: fixed bound on each update's L2 norm (0: adaptive, clip_quantile)", ge=0.0, lt=math.inf
    )
    clip_quantile: Num = option(
        0.5, "clip with clip_norm=0: the bound is this quantile of the round's norms", gt=0.0, le=1.0
    )
    trim_fraction: Num = option(0.2, "trimmed_mean: fraction cut at each end", ge=0.0, lt=0.5)
    krum_fraction: Num = option(0.1, "krum: assumed fraction of malicious replies per round", ge=0.0, lt=0.5)
    krum_m: Int = option(1, "krum: replies kept and merged (1: Krum, >1: Multi-Krum)", ge=1)
    outlier_z: Num = option(
        0.0, "drop replies whose update norm has a robust z-score above this (0: off)", ge=0.0, lt=math.inf
    )
    max_norm: Num = option(1.0e6, "a reply holding a tensor of L2 norm above this is rejected", gt=0.0, le=1e15)
    max_examples: Int | None = option(
        None,
        "the most training examples one reply's weight counts",
        allowed="null (the training set's size when known) or an integer >= 1",
        ge=1,
    )


@dataclass(frozen=True, config=DECLARED)
class DP:
    """Client-level DP (DP-FedAvg): clip each update, Gaussian noise on the aggregate."""

    enabled: Flag = option(False, "client-level differential privacy")
    clip: Num = option(1.0, "C: bound on each client's update norm", gt=0.0, lt=math.inf)
    noise_multiplier: Num = option(
        1.0, "sigma: noise std = sigma x C / (fraction_train x num_clients)", gt=0.0, lt=math.inf
    )
    delta: Num = option(1.0e-5, "epsilon is reported for this delta", gt=0.0, lt=1.0)
    seed: Int | None = option(
        None,
        "null: OS entropy; an int: reproducible, not private",
        allowed="null (OS entropy: the private setting) or an integer >= 0 (reproducible, not private)",
        ge=0,
    )


@dataclass(frozen=True, config=DECLARED)
class Tracking:
    tensorboard: Flag = option(True, "event files in <run dir>/tb")
    mlflow: Flag = option(False, "also log to MLflow (extra [mlflow])")
    mlflow_uri: Text | None = option(
        None,
        "null: a file store in <run dir>/mlruns; else a tracking URI",
        allowed="null (a file store in <run dir>/mlruns) or an MLflow tracking URI",
    )
    experiment: Text = option("fedhm", "MLflow experiment name")

    @model_validator(mode="after")
    def _uri(self) -> Self:
        if self.mlflow_uri == "":
            raise Refused("mlflow_uri")
        return self


def absolute_dir(value: str | None) -> bool:
    return value is None or Path(value).is_absolute()
