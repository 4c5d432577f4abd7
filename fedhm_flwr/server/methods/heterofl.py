"""HeteroFL (docs/METHODS.md#heterofl): width-sliced sub-models, averaged element-wise over their holders.

A level is a width rate ``r``; its clients train the same architecture with ``ceil(r·C)`` of the
``C`` channels of every hidden layer (the first ones: a static slice), with HeteroFL's Scaler and
gradient-norm clipping (``method.scaler``, ``method.grad_clip``); masked cross-entropy and sBN
come from the shared client. Each element of the global model becomes the plain mean over the
clients whose sub-model held it (classifier rows only over clients holding the class); elements
nobody trained keep their values. A level's deployable model is its sub-model sliced from the
global model (the Scaler is the identity in evaluation). The math is in :mod:`fedhm_flwr.math.width`.

Budget matching (``levels.match=fedhm_<resource>``, resource ``params``, ``macs`` or ``memory``):
``levels.ratios`` are then FedHM's rank ratios, which keep naming the levels (outputs, proportions,
declared capabilities), and each level trains the width rate whose sub-model's resource (parameters,
MACs, training memory) is the closest to FedHM's level of the same ratio on the same model
(:func:`fedhm_flwr.models.matching.matched_rates`); ``level_cost`` also reports FedHM's figure
(``fedhm_params``, ``fedhm_macs`` or ``fedhm_memory``).
"""

from __future__ import annotations

from logging import INFO
from typing import Any, ClassVar, Protocol, cast

import numpy as np
import torch

from fedhm_flwr.config.options import MethodOptions, RunOptions
from fedhm_flwr.config.options.width import HeteroFLOptions, WidthOptions
from fedhm_flwr.math import width
from fedhm_flwr.models import build_model, matching
from fedhm_flwr.server.methods.common import class_holds, classifier_keys
from fedhm_flwr.server.methods.method import Method, Reply, State, method_options


class SliceOptions(Protocol):
    """What HeteroFL reads of its options, whichever class :attr:`HeteroFL.reads` names."""

    @property
    def grad_clip(self) -> float: ...

    @property
    def weight_by_samples(self) -> bool: ...


class HeteroFL(Method):
    """Levels are width rates; level 1 is the full model."""

    name = "heterofl"
    options: ClassVar[type[MethodOptions]] = HeteroFLOptions
    #: the options class :meth:`__init__` reads (FedRolex's and FedAvg's family runs are WidthOptions);
    #: a subclass whose options are another class declares that class here
    reads: ClassVar[type[MethodOptions]] = WidthOptions
    #: how a level's channels are chosen: "static" (first k) or "rolling" (FedRolex's window)
    mode = "static"

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        m = cast(SliceOptions, method_options(opts, self.reads))
        self.spec = width.full_spec(self.spec)
        with torch.device("meta"):  # shapes only
            self._shapes_model = build_model(self.spec)
        self.classifier_keys = classifier_keys(self._shapes_model)
        self.scaler = isinstance(m, WidthOptions) and m.scaler
        self.grad_clip = m.grad_clip
        self.weight_by_samples = m.weight_by_samples
        #: each level's width rate: the level itself, or the rate matching FedHM's level on one resource
        self.rates, self.fedhm_costs = list(self.levels), None
        self.match = opts.levels.match
        if self.match != "none":
            self.rates, self.fedhm_costs = matching.matched_rates(
                self.spec,
                self.levels,
                resource=self.match.removeprefix("fedhm_"),
                batch_size=opts.train.batch_size,
                momentum=opts.train.momentum,
            )
        self.current_round = 1
        self._plans: dict[tuple[int, int], width.Plan] = {}

    def summary_lines(self) -> list[tuple[int, str, tuple[Any, ...]]]:
        if self.fedhm_costs is None:
            return []
        return [
            (
                INFO,
                "\t└──> Budget-matched widths (levels.match=%s): %s",
                (
                    self.match,
                    ", ".join(f"level {g:g} -> rate {r:g}" for g, r in zip(self.levels, self.rates)),
                ),
            )
        ]

    # -- plans

    def _plan_round(self, server_round: int) -> int:
        """The round a plan depends on (static slices do not depend on it)."""
        return server_round if self.mode == "rolling" else 1

    def plan(self, level_index: int, server_round: int | None = None) -> width.Plan:
        """The index plan of a level in a round (default: the current round); cached."""
        key = (level_index, self._plan_round(self.current_round if server_round is None else server_round))
        if key not in self._plans:
            self._plans[key] = width.index_plan(self._shapes_model, self.rates[level_index], self.mode, key[1])
        return self._plans[key]

    def level_spec(self, level_index: int) -> dict[str, Any]:
        """The model spec of a level's sub-model (the full spec at rate 1)."""
        return width.submodel_spec(self.spec, self.rates[level_index], self.scaler)

    # -- the method hooks

    def begin_round(self, server_round: int, global_state: State) -> None:
        self.current_round = server_round
        keep = self._plan_round(server_round)
        self._plans = {k: v for k, v in self._plans.items() if k[1] == keep}

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        state = width.slice_state(global_state, self.plan(level_index))
        return self.level_spec(level_index), state, {"grad_clip": self.grad_clip}

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        plans = [self.plan(r.level_index, server_round) for r in replies]
        weights = [float(r.num_examples) for r in replies] if self.weight_by_samples else None
        holds = class_holds(replies)
        return width.aggregate(global_state, [r.state for r in replies], plans, weights, holds, self.classifier_keys)

    def recovered(self, reply: Reply, global_state: State) -> tuple[State, State]:
        """The reply's width slice scattered into the global shapes (zeros elsewhere: uncovered
        elements are never read), with its coverage mask."""
        shapes = {k: v.shape for k, v in global_state.items()}
        return width.embed(reply.state, self.plan(reply.level_index), shapes)

    def reply_weights(self, replies: list[Reply]) -> np.ndarray:
        """1 per client (HeteroFL's plain mean over the holders), or its sample count."""
        return np.array([float(r.num_examples) if self.weight_by_samples else 1.0 for r in replies])

    def deployable(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State]:
        """The level's sub-model sliced from the global model (FedRolex: the current window)."""
        return self.level_spec(level_index), width.slice_state(global_state, self.plan(level_index))

    def cost_spec(self, level_index: int) -> dict[str, Any]:
        return self.level_spec(level_index)

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """With ``levels.match=fedhm_<resource>``, also FedHM's figure of the level on that resource
        (``fedhm_params``, ``fedhm_macs`` or ``fedhm_memory``)."""
        if self.fedhm_costs is None:
            return costs
        return {**costs, self.match: float(self.fedhm_costs[level_index])}
