"""Homogeneous FedAvg (docs/METHODS.md#fedavg): every client trains the same model.

``method.variant``: ``full`` (the full model, the upper bound) or ``smallest`` (the smallest
level's model: what a system bound by its weakest client would do). ``method.family`` says whose
smallest level: ``fedhm`` (default; the hybrid low-rank model at ``gamma = min(levels.ratios)``,
cut from the global model by SVD each round and recovered to full rank, FedHM's client options
``rho`` / ``frobenius_decay``) or ``heterofl`` (the width sub-model at ``rate = min(levels.ratios)``
with HeteroFL's Scaler and clipping). The family's strategy does the work with one level and
weights ``n_p / sum n`` (plain FedAvg by sample count; FedHM's ``tau = inf`` with
``weight_by_samples``); classifier rows are averaged per class like every method here.

For ``variant=smallest family=heterofl`` the trained model *is* the small one: the server's
full-shape state beyond its channels is never trained, so ``acc/global`` reports the small model.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr import evaluation as ev

from .base import HeteroStrategy, Reply, State
from .fedhm import FedHMStrategy
from .heterofl import HeteroFLStrategy


def _one_level_config(cfg: DictConfig, level: float, method: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with the single level ``level`` and the given method group."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["levels"] = {**plain["levels"], "ratios": [level], "proportions": [1], "default": None}
    plain["method"] = method
    return OmegaConf.create(plain)


class FedAvgStrategy(HeteroStrategy):
    """One level for everyone; the work is done by a FedHM or HeteroFL strategy with that level."""

    name = "fedavg"

    def __init__(self, cfg, model_spec, evaluate_fn=None, recorder=None) -> None:
        m = cfg.method
        self.variant, self.family = str(m.variant), str(m.family)
        level = 1.0 if self.variant == "full" else min(float(r) for r in cfg.levels.ratios)
        if self.family == "fedhm":
            inner_method = {"name": "fedhm", "tau": float("inf"), "weight_by_samples": True, "rho": m.rho,
                            "frobenius_decay": bool(m.frobenius_decay)}
            inner_cls: type[HeteroStrategy] = FedHMStrategy
        else:
            inner_method = {"name": "heterofl", "scaler": bool(m.scaler), "grad_clip": float(m.grad_clip),
                            "weight_by_samples": True}
            inner_cls = HeteroFLStrategy
        own_method = OmegaConf.to_container(m, resolve=True)
        super().__init__(_one_level_config(cfg, level, own_method), model_spec, evaluate_fn, recorder)
        self.inner = inner_cls(_one_level_config(cfg, level, inner_method), model_spec)
        self.spec = dict(self.inner.spec)
        self.classifier_keys = self.inner.classifier_keys
        #: the global model is the small width model itself (see the module docstring)
        self.global_is_level = self.family == "heterofl" and level < 1.0

    def begin_round(self, server_round: int, global_state: State) -> None:
        self.inner.begin_round(server_round, global_state)

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        return self.inner.level_payload(level_index, global_state)

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        return self.inner.merge(server_round, global_state, replies)

    def deployable(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State]:
        return self.inner.deployable(level_index, global_state)

    def recovered(self, reply: Reply) -> tuple[State, dict[str, Any] | None]:
        self.inner.global_state = self.global_state
        return self.inner.recovered(reply)

    def reply_weights(self, replies: list[Reply]) -> Any:
        return self.inner.reply_weights(replies)

    def cost_spec(self, level_index: int) -> dict[str, Any] | None:
        return self.inner.cost_spec(level_index)

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        return self.inner.extra_costs(level_index, model, costs)

    def evaluate_levels(self, global_state: State) -> dict[str, Any]:
        if not self.global_is_level:
            return super().evaluate_levels(global_state)
        if self.evaluate_fn is None:
            return {}
        bn = ev.BnUse(str(self.cfg.evaluation.bn_stats))
        m = ev.evaluate_model(self, *self.deployable(0, global_state), bn)
        out: dict[str, Any] = {"acc/global": m["accuracy"], "loss/global": m["loss"]}
        if self.cfg.evaluation.levels:
            out[f"acc/level_{self.levels[0]:g}"], out[f"loss/level_{self.levels[0]:g}"] = m["accuracy"], m["loss"]
        return {**out, **bn.row()}
