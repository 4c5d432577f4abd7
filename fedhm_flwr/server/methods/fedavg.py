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

import dataclasses
import math
from typing import Any

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.config.options.factorized import FedHMOptions
from fedhm_flwr.config.options.fedavg import FedAvgOptions
from fedhm_flwr.config.options.width import HeteroFLOptions
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.method import Method, State, method_options


def family_options(opts: RunOptions) -> RunOptions:
    """The run's options as the family's method sees them: one level (1, or the smallest of
    ``levels.ratios``) and the family's method options (FedHM at ``tau = inf`` weighted by samples,
    or HeteroFL weighted by samples) with ``method.*``'s client options."""
    m = method_options(opts, FedAvgOptions)
    level = 1.0 if m.variant == "full" else min(opts.levels.ratios)
    inner: FedHMOptions | HeteroFLOptions
    if m.family == "fedhm":
        inner = FedHMOptions(
            tau=math.inf,
            weight_by_samples=True,
            rho=m.rho,
            frobenius_decay=m.frobenius_decay,
            svd_tolerance=None,
            official_weights=False,
            add_previous_global=False,
        )
    else:
        inner = HeteroFLOptions(scaler=m.scaler, grad_clip=m.grad_clip, weight_by_samples=True)
    levels = dataclasses.replace(opts.levels, ratios=(level,), proportions=(1.0,), default=None)
    return dataclasses.replace(opts, levels=levels, method=inner)


class FedAvgFedHM(FedHM):
    """FedAvg of FedHM's family: FedHM with one level."""

    name = "fedavg"
    options = FedAvgOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        m = method_options(opts, FedAvgOptions)
        self.variant, self.family = m.variant, m.family
        super().__init__(family_options(opts), model_spec)


class FedAvgHeteroFL(HeteroFL):
    """FedAvg of HeteroFL's family: HeteroFL with one level; below rate 1 the global model is the
    small width model itself (see the module docstring)."""

    name = "fedavg"
    options = FedAvgOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        m = method_options(opts, FedAvgOptions)
        self.variant, self.family = m.variant, m.family
        super().__init__(family_options(opts), model_spec)

    def global_model(self, global_state: State) -> tuple[dict[str, Any], State]:
        if self.levels[0] < 1.0:
            return self.deployable(0, global_state)
        return super().global_model(global_state)


class FedAvg:
    """The FedAvg method ``method.family`` names: ``FedAvg(opts, model_spec)`` builds a
    :class:`FedAvgFedHM` or a :class:`FedAvgHeteroFL`. It declares the validation both share, as a
    :class:`~fedhm_flwr.server.methods.method.Method` does."""

    name = "fedavg"
    options = FedAvgOptions

    def __new__(cls, opts: RunOptions, model_spec: dict[str, Any]) -> Method:  # type: ignore[misc]
        fedhm_family = method_options(opts, FedAvgOptions).family == "fedhm"
        return (FedAvgFedHM if fedhm_family else FedAvgHeteroFL)(opts, model_spec)
