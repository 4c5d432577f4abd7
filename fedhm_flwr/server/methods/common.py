"""Helpers every method uses: the classifier's state keys and the costs of a level's model.

:class:`fedhm_flwr.server.methods.method.LevelCosts` is the one place a level's costs are computed (once per
level); a method only names the model its clients of a level train (``cost_spec``) and adds its own
figures (``extra_costs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.math.aggregation import level_weights
from fedhm_flwr.models import build_model, input_shape, shape_device
from fedhm_flwr.models.adapters import trainable_state
from fedhm_flwr.models.costs import model_costs
from fedhm_flwr.models.rules import head_name

Costs = dict[str, float]


def classifier_keys(model: nn.Module) -> list[str]:
    """State keys of the classifier head (:func:`fedhm_flwr.models.rules.head_name`: the model's
    ``classifier_name``, else its last Linear): their first dimension indexes classes, so they
    are aggregated per class. None when the head is factorized (``classifier_name`` empty)."""
    name = head_name(model)
    return [k for k in model.state_dict() if k.startswith(f"{name}.")] if name else []


def gamma_weights(replies: Sequence[Any], tau: float, by_samples: bool) -> np.ndarray:
    """FedHM's ``softmax(γ/τ)`` weights of the replies' levels (docs/METHODS.md#fedhm), times
    their sample counts with ``by_samples`` (``method.weight_by_samples``)."""
    counts = [r.num_examples for r in replies] if by_samples else None
    return level_weights([r.level for r in replies], tau, counts)


def class_holds(replies: Sequence[Any]) -> np.ndarray:
    """(replies × classes): whether each reply's client held each class (its ``class_counts`` above
    zero), as the per-class averages take it; one comparison for all the replies."""
    return np.stack([r.class_counts for r in replies]) > 0


def record_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of ``state`` in a message, counted as the round counts them (``ArrayRecord.count_bytes``)."""
    return int(
        ArrayRecord.from_torch_state_dict({k: v.detach().float().contiguous() for k, v in state.items()}).count_bytes()
    )


def trained_costs(model: nn.Module, head_keys: list[str]) -> Costs:
    """A partly frozen model's costs (the transformer track): ``params`` trained (and sent),
    ``head_params`` of them in the classifier, ``frozen_params`` never sent, ``bytes_up`` of the reply."""
    trained = trainable_state(model)
    return {
        "params": float(sum(v.numel() for v in trained.values())),
        "head_params": float(sum(v.numel() for k, v in trained.items() if k in head_keys)),
        "frozen_params": float(sum(p.numel() for p in model.parameters() if not p.requires_grad)),
        "bytes_up": float(record_bytes(trained)),
    }


def level_costs(
    spec: dict[str, Any] | None,
    opts: RunOptions,
    *,
    frozen_backbone: bool,
    head_keys: list[str],
    extra: Callable[[nn.Module, Costs], Costs],
) -> Costs:
    """The costs of the model ``spec`` describes (``{}`` when None), refined by ``extra(model, costs)``.

    ``frozen_backbone=False``: :func:`model_costs`, counted on a shapes-only (meta) model.
    ``frozen_backbone=True``: :func:`trained_costs` of the model built from seed 0.
    """
    if spec is None:
        return {}
    if frozen_backbone:
        torch.manual_seed(0)
        model = build_model(spec)
        return extra(model, trained_costs(model, head_keys))
    with shape_device(spec):  # shapes only (meta; CPU for a model the meta device cannot build)
        model = build_model(spec, spectral_init=False)
        costs = model_costs(model, input_shape(spec), opts.train.batch_size, opts.train.momentum)
        return extra(model, costs)
