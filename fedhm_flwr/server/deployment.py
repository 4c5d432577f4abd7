"""Deployment statistics: the fixed norm statistics every level's exported model carries (static
BN), summed by the clients over their training data at the end of the run (the sBN query of
:func:`fedhm_flwr.server.evaluation.federated_bn_sums`, every level's model in one message per node).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import torch
from flwr.supercore import log

from fedhm_flwr.math.bn_stats import batch_statistics_layers
from fedhm_flwr.models import build_model, shape_device
from fedhm_flwr.server.evaluation import RoundView, federated_bn_sums, spec_key
from fedhm_flwr.server.methods.method import State


def deployment_statistics(view: RoundView, global_state: State,
                          known: dict[str, dict[str, torch.Tensor]] | None = None,
                          ) -> tuple[dict[str, torch.Tensor], dict[str, str], int] | None:
    """Fixed norm statistics for every level's deployable model that normalises with batch
    statistics (static BN): the clients' sums over their training data (the sBN query, every
    level's model in one message per node), keyed ``level_<γ>/<layer>.<sum|sumsq|count>``, with
    metadata and the bytes moved; None when no model needs them (no static norm layer, or running
    statistics) or nobody answered. ``known``: sums this model version's evaluation already asked
    for (by :func:`spec_key`), not asked again. A deployed model predicts in eval mode with these,
    independently of the batch."""
    found: dict[float, dict[str, torch.Tensor] | None] = {}
    ask: list[tuple[float, tuple[dict[str, Any], State]]] = []
    for index, level in enumerate(view.method.levels):
        spec, state = view.method.deployable(index, global_state)
        if spec.get("trainable_only"):
            return None
        with shape_device(spec):
            layers = batch_statistics_layers(build_model(spec, spectral_init=False))
        if not layers:
            continue
        sums = (known or {}).get(spec_key(spec))
        if sums is None:
            ask.append((level, (spec, state)))
        found[level] = sums
    nbytes = 0
    if ask:
        asked, nbytes = federated_bn_sums(view, [model for _, model in ask])
        found.update({level: sums for (level, _), sums in zip(ask, asked)})
    tensors: dict[str, torch.Tensor] = {}
    for level, sums in found.items():
        if sums is None:
            log(WARNING, "deployment statistics: no client answered for level %g; its export falls back", level)
            continue
        tensors.update({f"level_{level:g}/{k}": v for k, v in sums.items()})
    if not tensors:
        return None
    limit = int(view.cfg.evaluation.bn_clients)
    asked_count = min(limit, len(view.registry.nodes)) if limit > 0 else len(view.registry.nodes)
    return tensors, {"source": "federated", "nodes_asked": str(asked_count)}, nbytes
