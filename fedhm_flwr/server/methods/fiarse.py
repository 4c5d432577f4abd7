"""FIARSE (docs/METHODS.md#fiarse): sub-models extracted by parameter magnitude, trained masked.

Wu et al., NeurIPS 2024; the official code is HarliWu/FIARSE (``fiarse/``). A level is a size ``s``:
every round, one global threshold ``θ_s`` over the magnitudes of all conv/linear weights and biases
of the global model keeps the ``int(s·numel)`` largest (:func:`fedhm_flwr.math.fiarse.threshold`).
A client of the level receives the full-shape model with the elements below ``θ_s`` set to 0 and
``θ_s`` itself, and trains with the masked forward ``w · 1[|w| ≥ θ_s]`` (the client hook
:mod:`fedhm_flwr.math.fiarse`, the mask taken again on the current weights at every forward, as the
official masked layers do). The server adds ``−η · Σ δ_i / #{i : δ_i ≠ 0}`` per element, ``δ_i`` a
client's change (:func:`fedhm_flwr.math.fiarse.aggregate`; ``η`` = ``method.server_lr``).
A level's deployable model is the global model extracted at its size; the global model is size 1.

Costs: the client holds and computes on full-shape dense tensors, so ``params``, ``macs``, ``bytes``
are the full model's at every level, and ``memory`` adds what the masked forward keeps for the
backward (the masked weights in float32 and the boolean masks); ``kept_params`` is how many
parameters the sub-model keeps (docs/METHODS.md#fiarse says what that saves and what it does not).
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import torch

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.config.options.fiarse import FIARSEOptions
from fedhm_flwr.math import fiarse
from fedhm_flwr.models import build_model, matching
from fedhm_flwr.server.methods.common import classifier_keys
from fedhm_flwr.server.methods.method import Method, Reply, State, method_options

#: bytes the masked forward keeps for the backward per masked weight element (the masked weight in
#: float32, which the conv or linear saves, and its boolean mask) and per masked bias element (its mask)
WEIGHT_BYTES, BIAS_BYTES = 4 + 1, 1


class FIARSE(Method):
    """Levels are sizes: each level keeps the largest-magnitude fraction of the weights."""

    name = "fiarse"
    options = FIARSEOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        m = method_options(opts, FIARSEOptions)
        self.server_lr = m.server_lr
        self.gradient = m.gradient
        with torch.device("meta"):  # shapes only
            shapes_model = build_model(self.spec)
        self.classifier_keys = classifier_keys(shapes_model)
        #: the state keys masked (the weights and biases of every Conv2d and Linear)
        self.keys = fiarse.masked_keys(shapes_model)
        sizes = {k: shapes_model.state_dict()[k].numel() for k in self.keys}
        self.masked_numel = sum(sizes.values())
        #: what the masked forward keeps for the backward beyond the dense model's training memory
        self.mask_bytes = sum((BIAS_BYTES if k.endswith("bias") else WEIGHT_BYTES) * n for k, n in sizes.items())
        #: each level's size: the level itself, or (``levels.match=fedhm_params``) the size whose sub-model
        #: keeps FedHM's parameter count at the level's rank ratio
        self.sizes, self.fedhm_costs = list(self.levels), None
        if opts.levels.match == "fedhm_params":
            params = sum(p.numel() for p in shapes_model.parameters() if p.requires_grad)
            self.fedhm_costs = matching.fedhm_level_costs(self.spec, self.levels, resource="params")
            self.sizes = [fiarse.matched_size(t, params, self.masked_numel) for t in self.fedhm_costs]

    def threshold(self, level_index: int, global_state: State) -> float:
        """``θ`` of the level's size on ``global_state``."""
        return fiarse.threshold(global_state, self.keys, self.sizes[level_index])

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        theta = self.threshold(level_index, global_state)
        options = {"hook": "fiarse", "hook_options": {"threshold": theta, "gradient": self.gradient}}
        return self.spec, fiarse.extract(global_state, self.keys, theta), options

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        sent: dict[int, State] = {}
        for r in replies:  # what each level's clients were sent (one extraction per level)
            if r.level_index not in sent:
                theta = self.threshold(r.level_index, global_state)
                sent[r.level_index] = fiarse.extract(global_state, self.keys, theta)
        return fiarse.aggregate(
            global_state, [sent[r.level_index] for r in replies], [r.state for r in replies], self.server_lr
        )

    def cost_spec(self, level_index: int) -> dict[str, Any]:
        return self.spec  # full-shape tensors at every size

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """The dense figures, the training memory with the masked forward's saved tensors, and the
        parameters the sub-model keeps (``kept_params``: its masked elements kept and every other
        parameter)."""
        kept = fiarse.kept_count(self.masked_numel, self.sizes[level_index])
        out = {
            **costs,
            "memory": costs["memory"] + self.mask_bytes,
            "kept_params": float(costs["params"] - self.masked_numel + kept),
        }
        if self.fedhm_costs is not None:
            out["fedhm_params"] = float(self.fedhm_costs[level_index])
        return out

    def summary_lines(self) -> list[tuple[int, str, tuple[Any, ...]]]:
        """With ``levels.match=fedhm_params``: each level's size and the parameters it keeps."""
        if self.fedhm_costs is None:
            return []
        sizes = ", ".join(f"level {g:g} -> size {s:.4g}" for g, s in zip(self.levels, self.sizes, strict=True))
        return [(INFO, "\t└──> Parameter-matched sizes (levels.match=fedhm_params): %s", (sizes,))]
