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

from fedhm_flwr.config.methods import FedAvgOptions
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.method import Method, State


def _one_level_config(cfg: DictConfig, level: float, method: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with the single level ``level`` and the given method group."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["levels"] = {**plain["levels"], "ratios": [level], "proportions": [1], "default": None}
    plain["method"] = method
    return OmegaConf.create(plain)


def family_config(cfg: DictConfig) -> DictConfig:
    """The run's config as the family's method sees it: one level (1, or the smallest of
    ``levels.ratios``) and the family's method group (FedHM at ``tau = inf`` weighted by samples,
    or HeteroFL weighted by samples) with ``method.*``'s client options."""
    m = cfg.method
    level = 1.0 if str(m.variant) == "full" else min(float(r) for r in cfg.levels.ratios)
    if str(m.family) == "fedhm":
        inner = {
            "name": "fedhm",
            "tau": float("inf"),
            "weight_by_samples": True,
            "rho": m.rho,
            "frobenius_decay": bool(m.frobenius_decay),
        }
    else:
        inner = {
            "name": "heterofl",
            "scaler": bool(m.scaler),
            "grad_clip": float(m.grad_clip),
            "weight_by_samples": True,
        }
    return _one_level_config(cfg, level, inner)


class FedAvgFedHM(FedHM):
    """FedAvg of FedHM's family: FedHM with one level."""

    name = "fedavg"
    options = FedAvgOptions

    def __init__(self, cfg: DictConfig, model_spec: dict[str, Any]) -> None:
        self.variant, self.family = str(cfg.method.variant), str(cfg.method.family)
        super().__init__(family_config(cfg), model_spec)


class FedAvgHeteroFL(HeteroFL):
    """FedAvg of HeteroFL's family: HeteroFL with one level; below rate 1 the global model is the
    small width model itself (see the module docstring)."""

    name = "fedavg"
    options = FedAvgOptions

    def __init__(self, cfg: DictConfig, model_spec: dict[str, Any]) -> None:
        self.variant, self.family = str(cfg.method.variant), str(cfg.method.family)
        super().__init__(family_config(cfg), model_spec)

    def global_model(self, global_state: State) -> tuple[dict[str, Any], State]:
        if self.levels[0] < 1.0:
            return self.deployable(0, global_state)
        return super().global_model(global_state)


class FedAvg:
    """The FedAvg method ``method.family`` names: ``FedAvg(cfg, model_spec)`` builds a
    :class:`FedAvgFedHM` or a :class:`FedAvgHeteroFL`. It declares the validation both share, as a
    :class:`~fedhm_flwr.server.methods.method.Method` does."""

    name = "fedavg"
    options = FedAvgOptions

    def __new__(cls, cfg: DictConfig, model_spec: dict[str, Any]) -> Method:  # type: ignore[misc]
        return (FedAvgFedHM if str(cfg.method.family) == "fedhm" else FedAvgHeteroFL)(cfg, model_spec)

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Refuse a bad ``method`` group of ``cfg`` (what :func:`fedhm_flwr.config.load_config` runs)."""
        cls.options.check(cfg)
