"""A method apart from the round: how a client's model is cut out of the global model, and how the
replies are folded back in. No Flower import: the round (:mod:`fedhm_flwr.server.strategy`) does the messaging.

A method (``fedhm_flwr/server/methods/<name>.py``) subclasses :class:`Method` and provides :meth:`Method.level_payload`
and :meth:`Method.merge`; the other hooks have defaults that fit most methods. Its inputs and
outputs are tensors (a state dict per model) and plain data (:class:`Reply`, :class:`Cut`); what
travels, how it is checked and how the round is recorded are the round's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fedhm_flwr.config.options import MethodOptions, RunOptions
from fedhm_flwr.server.methods import common

State = dict[str, torch.Tensor]
OptionsT = TypeVar("OptionsT", bound=MethodOptions)


def method_options(opts: RunOptions, kind: type[OptionsT] | tuple[type[OptionsT], ...]) -> OptionsT:
    """``opts.method`` as the method's own options class ``kind`` (or one of several): a run built
    for another method is refused with a TypeError naming both (an ``assert`` would vanish under
    ``python -O``)."""
    if not isinstance(opts.method, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TypeError(f"method options: {names} expected, got {type(opts.method).__name__}")
    return opts.method


@dataclass
class Cut:
    """One node's (or level's) model for this round, as tensors: what the round serialises and sends."""

    spec: dict[str, Any]
    state: State
    train: dict[str, Any] = field(default_factory=dict)  # method-specific client options
    returned: tuple[str, ...] | None = None  # keys a reply must hold (None: the keys sent)


@dataclass
class Reply:
    """A validated training reply (checked by the round against what was sent)."""

    node_id: int
    level_index: int
    level: float
    state: State
    num_examples: int
    class_counts: np.ndarray
    metrics: dict[str, float]
    label: str = ""  # how outputs name the node (p<partition>, its name, n<node id>)
    sent: Any = None  # what the node was sent (the round's payload; the defences recover it)


class LevelCosts(Sequence[dict[str, float]]):
    """A method's per-level costs as data (level index -> costs), each counted once, when first read:
    what the node registry maps declared budgets with, ``inspect`` and the summary report."""

    def __init__(self, method: Method) -> None:
        self._method = method
        self._cache: dict[int, dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._method.levels)

    def __getitem__(self, index: int) -> dict[str, float]:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index not in self._cache:
            m = self._method
            self._cache[index] = common.level_costs(
                m.cost_spec(index),
                m.opts,
                frozen_backbone=m.frozen_backbone,
                head_keys=m.classifier_keys,
                extra=lambda model, costs: m.extra_costs(index, model, costs),
            )
        return self._cache[index]


class Method(ABC):
    """One algorithm: levels, the cut of a level's model, the merge of the replies, the costs."""

    #: method name, as in ``method.name``
    name = "base"
    #: what the method accepts of a config (its ``method`` group, its models): a torch-free class
    #: of :mod:`fedhm_flwr.config.methods`, the one the config check uses for ``name``
    options: ClassVar[type[MethodOptions]]
    #: the clients train part of a frozen model (the transformer track): costs count what they train
    frozen_backbone = False

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        self.opts = opts  # the run's options (FedAvg: as its family's method runs them)
        self.spec = dict(model_spec)
        self.levels: list[float] = list(opts.levels.ratios)
        self.classifier_keys: list[str] = []
        self.costs = LevelCosts(self)

    # ------------------------------------------------------------------ per round

    def begin_round(self, server_round: int, global_state: State) -> None:  # noqa: B027 (optional hook)
        """Work done once per round before any payload (FedHM: one SVD per layer)."""

    @abstractmethod
    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        """(model spec, arrays, method train options) of one level's client model."""

    def node_cut(self, node_id: int, key: int, level_index: int, global_state: State) -> Cut | None:
        """A node's own model when the method cuts one per client (PriSM samples kernels per client;
        ``key``: the node's stable key, which seeds its draw); None: its level's shared cut."""
        return None

    def level_cut(self, level_index: int, global_state: State) -> Cut:
        """A level's model for this round, shared by the level's nodes."""
        spec, state, options = self.level_payload(level_index, global_state)
        returned = self.reply_keys(level_index, spec, state)
        return Cut(spec, state, options, None if returned is None else tuple(returned))

    def reply_keys(self, level_index: int, spec: dict[str, Any], state: State) -> list[str] | None:
        """Keys a client of this level sends back, when not all it received (e.g. only the trainable
        ones of a partly frozen model); None: the keys it received."""
        return None

    @abstractmethod
    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        """Fold the validated replies back into a new global state."""

    def recovered(self, reply: Reply, global_state: State) -> tuple[State, dict[str, torch.Tensor] | None]:
        """A reply as a full-shape model over the global state's keys, and its coverage (key ->
        boolean mask of the elements it holds; None: every element of every key it has). Robust
        aggregation and DP work on these (:mod:`fedhm_flwr.server.untrusted`). Default: the reply
        as it is (full-shape, covering everything it holds)."""
        return dict(reply.state), None

    def reply_weights(self, replies: list[Reply]) -> np.ndarray | None:
        """The weight of each reply in the method's average over the clients covering an element
        (used by the clipping defence and DP); None (the default): the method's merge is not such an average."""
        return None

    # ------------------------------------------------------------------ models

    def initial_state(self, seed: int) -> State | None:
        """The initial global state when it is not the spec's seeded model (None: that model)."""
        return None

    def global_model(self, global_state: State) -> tuple[dict[str, Any], State]:
        """The model evaluated as ``global`` every round (default: the global state as it is)."""
        return self.spec, global_state

    def deployable(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State]:
        """The model a client of this level would deploy (evaluated every round)."""
        spec, state, _ = self.level_payload(level_index, global_state)
        return spec, state

    # ------------------------------------------------------------------ costs

    def level_cost(self, level_index: int) -> dict[str, float]:
        """Costs of a level's client model (parameters, MACs, bytes, memory, ...; ``{}`` for a method
        that names no model): :attr:`costs`, counted once per level."""
        return self.costs[level_index]

    def cost_spec(self, level_index: int) -> dict[str, Any] | None:
        """The spec of the model a client of this level trains, whose costs are the level's (None: no costs)."""
        return None

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """A level's costs as reported, from the counted ones (``model``: the counted model)."""
        return costs

    # ------------------------------------------------------------------ checkpoint and logging

    def strategy_state(self) -> dict[str, Any]:
        """Method state beyond the global model that a checkpoint must keep."""
        return {}

    def load_strategy_state(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore :meth:`strategy_state`."""

    def summary_lines(self) -> list[tuple[int, str, tuple[Any, ...]]]:
        """Extra start-of-run log lines, as ``(level, format, args)``."""
        return []
