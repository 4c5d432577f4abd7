"""FedHM (docs/METHODS.md#fedhm): hybrid low-rank client models cut by SVD, recovered and averaged.

One decomposition per factorizable layer per model version, whoever asks (hand-out, evaluation
of each level's deployable model, checkpoint): the cache is keyed by the layer's content, not by
the state dict's identity. Every level's client model is a truncation of that one decomposition
(:func:`fedhm_flwr.math.lowrank.layer_svd`: float32 ``eigh`` of the Gram matrix, checked after the fact
against ``method.svd_tolerance`` at every level's rank). Replies are averaged with
``softmax(gamma / tau)`` weights, classifier rows per class, each factorized layer's recovery and average as one stacked
matrix product.

Official-code behaviour (off by default; for comparisons with the published code):
``method.official_weights`` uses its weights (:func:`fedhm_flwr.math.aggregation.official_code_weights`);
``method.add_previous_global`` adds the previous global model as one more reply at ``gamma = 1``
(holding every class; with ``weight_by_samples`` it counts the mean sample count of the round's
replies) when no full-rank client's reply is in the round.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from fedhm_flwr.config.options import MethodOptions, RunOptions
from fedhm_flwr.config.options.factorized import FedHMOptions
from fedhm_flwr.math.aggregation import average_hybrid, level_weights, official_code_weights
from fedhm_flwr.math.lowrank import (
    SVD_TOLERANCE,
    WireFactors,
    compute_svds,
    factorize_state,
    recover_state,
    wire_factors,
)
from fedhm_flwr.models import build_model
from fedhm_flwr.models.rules import plan_ranks
from fedhm_flwr.server.methods.common import class_holds, classifier_keys, gamma_weights
from fedhm_flwr.server.methods.method import Method, Reply, State, method_options


class FedHM(Method):
    """Levels are rank ratios gamma; level 1 is the full model."""

    name = "fedhm"
    options: ClassVar[type[MethodOptions]] = FedHMOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        m = method_options(opts, FedHMOptions)
        model = build_model(self.spec)
        rho = m.rho
        self.ranks: list[dict[str, int]] = [plan_ranks(model, g, rho) for g in self.levels]
        self.factorized = sorted({name for ranks in self.ranks for name in ranks})
        self.classifier_keys = classifier_keys(model)
        self.tau = m.tau
        self.frobenius_decay = m.frobenius_decay
        self.layer_ranks = {name: sorted({r[name] for r in self.ranks if name in r}) for name in self.factorized}
        self.svd_tolerance = SVD_TOLERANCE if m.svd_tolerance is None else m.svd_tolerance
        self.weight_by_samples = m.weight_by_samples
        self.add_previous_global = m.add_previous_global
        self.official_weights = m.official_weights
        self.dynamic = opts.levels.assignment == "dynamic"
        # layer -> (weight its SVD was computed from, that weight's version counter: an in-place change
        # voids it, the SVD's factors up to the layer's top rank in the wire layout)
        self._factor_cache: dict[str, tuple[torch.Tensor, int, WireFactors]] = {}
        self._level_states: dict[int, tuple[list[tuple[str, torch.Tensor, int]], State]] = {}  # _level_state

    def level_spec(self, level_index: int) -> dict[str, Any]:
        ranks = self.ranks[level_index]
        return {**self.spec, "ranks": ranks} if ranks else dict(self.spec)

    def _factors(self, global_state: State) -> dict[str, WireFactors]:
        """One SVD per factorizable layer of this global state, kept as its factors up to the layer's
        largest level rank (every level cuts its own rank out of them: :func:`lowrank.factorize_state`),
        reused while the layer's weight is unchanged (same tensor, or equal content: the evaluation and
        the next round receive the merged state through a fresh ArrayRecord; a tensor changed in place
        since is not)."""

        def fresh(name: str) -> bool:
            cached, weight = self._factor_cache.get(name), global_state[f"{name}.weight"]
            return (
                cached is not None
                and cached[0]._version == cached[1]
                and (cached[0] is weight or (cached[0].shape == weight.shape and torch.equal(cached[0], weight)))
            )

        stale = [name for name in self.factorized if not fresh(name)]
        for name, svd in compute_svds(global_state, stale, self.layer_ranks, self.svd_tolerance).items():
            weight = global_state[f"{name}.weight"]
            factors = wire_factors(svd, weight.shape, max(self.layer_ranks[name]))
            self._factor_cache[name] = (weight, weight._version, factors)
        return {name: self._factor_cache[name][2] for name in self.factorized}

    def begin_round(self, server_round: int, global_state: State) -> None:
        self._factors(global_state)

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        ranks = self.ranks[level_index]
        state = self._level_state(level_index, global_state) if ranks else dict(global_state)
        return self.level_spec(level_index), state, {"frobenius_decay": self.frobenius_decay}

    def _level_state(self, level_index: int, global_state: State) -> State:
        """A level's hybrid state, cut once per model version: the evaluation's deployable model and
        the next round's payload are the same tensors (so the payload's Arrays are serialised once
        too). Recognised by the global state's tensors themselves (held, so never confused with
        later ones) and their version counters (an in-place change makes them new)."""
        held = self._level_states.get(level_index)
        if (
            held is not None
            and len(held[0]) == len(global_state)
            and all(
                key == k and tensor is t and tensor._version == v
                for (key, tensor), (k, t, v) in zip(global_state.items(), held[0])
            )
        ):
            return dict(held[1])
        state = factorize_state(global_state, self.ranks[level_index], factors=self._factors(global_state))
        self._level_states[level_index] = ([(k, t, t._version) for k, t in global_state.items()], state)
        return dict(state)

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        states = [r.state for r in replies]
        ranks = [self.ranks[r.level_index] for r in replies]
        levels = [r.level for r in replies]
        counts = [r.num_examples for r in replies] if self.weight_by_samples else None
        holds = class_holds(replies)
        if self.add_previous_global and 1.0 not in levels:
            states.append(global_state)  # the previous global model as one more full-rank reply
            ranks.append({})
            levels.append(1.0)
            holds = np.vstack([holds, np.ones_like(holds[0])])  # (it holds every class)
            if counts is not None:
                counts.append(max(1, round(sum(counts) / len(counts))))
        return average_hybrid(global_state, states, ranks, self.weights(levels, counts), holds, self.classifier_keys)

    def recovered(self, reply: Reply, global_state: State) -> tuple[State, None]:
        """Every factorized layer ``L.a.weight``/``L.b.weight`` of the reply recovered to ``L.weight =
        A·B`` at the rank the factors have, ``L.a.bias -> L.bias``; the reply covers everything it holds."""
        ranks = {
            key[: -len(".b.weight")]: int(reply.state[key[: -len(".b.weight")] + ".a.weight"].shape[1])
            for key in reply.state
            if key.endswith(".b.weight") and key[: -len(".b.weight")] + ".a.weight" in reply.state
        }
        return (recover_state(reply.state, ranks) if ranks else dict(reply.state)), None

    def reply_weights(self, replies: list[Reply]) -> np.ndarray:
        """The journal's ``softmax(γ/τ)`` (times the sample counts with ``method.weight_by_samples``),
        as the defences and DP weigh the replies."""
        return gamma_weights(replies, self.tau, self.weight_by_samples)

    def weights(self, levels: list[float], counts: list[int] | None) -> np.ndarray:
        """The round's aggregation weights: the journal's ``softmax(gamma / tau)``, or the
        official code's (``method.official_weights``)."""
        if self.official_weights:
            return official_code_weights(levels, self.tau, self.dynamic, counts)
        return level_weights(levels, self.tau, counts)

    def cost_spec(self, level_index: int) -> dict[str, Any]:
        return self.level_spec(level_index)
