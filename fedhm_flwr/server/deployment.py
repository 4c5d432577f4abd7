"""Deployment statistics: the fixed norm statistics every level's exported model carries (static
BN), summed by the clients over their training data at the end of the run (the sBN query of
:class:`fedhm_flwr.server.bn_query.BnQuery`, every level's model in one message per node, at most
``evaluation.bn_examples`` examples a node).

The query is asked before the last round's evaluation on the server (:class:`DeploymentQuery`: the
nodes compute while the server evaluates) and read after it, unless that evaluation asks the nodes
for the same sums itself (``evaluation.bn_stats=federated``): then its sums are reused.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import torch
from flwr.supercore import log

from fedhm_flwr.math.bn_stats import batch_statistics_layers
from fedhm_flwr.models import build_model, shape_device
from fedhm_flwr.server.bn_query import BnQuery, Sums, asked_nodes_of, spec_key
from fedhm_flwr.server.methods.method import State


class DeploymentQuery:
    """Every level's deployable model that normalises with batch statistics, and its sums: those
    in ``known`` (by :func:`spec_key`, asked already by this model version's evaluation), the others
    asked now. ``view``: the round's :class:`fedhm_flwr.server.evaluation.RoundView`."""

    def __init__(self, view: Any, global_state: State, known: dict[str, Sums] | None = None) -> None:
        self.view = view
        self.needed = True  # False: no level's model needs fixed statistics (none normalises with its batch)
        self.found: dict[float, Sums | None] = {}
        ask: list[tuple[float, tuple[dict[str, Any], State]]] = []
        for index, level in enumerate(view.method.levels):
            spec, state = view.method.deployable(index, global_state)
            if spec.get("trainable_only"):
                self.needed = False
                break
            with shape_device(spec):
                layers = batch_statistics_layers(build_model(spec, spectral_init=False))
            if not layers:
                continue
            sums = (known or {}).get(spec_key(spec))
            if sums is None:
                ask.append((level, (spec, state)))
            self.found[level] = sums
        self.asked = [level for level, _ in ask] if self.needed else []
        self.query = BnQuery(view, [model for _, model in ask]) if self.needed and ask else None

    def result(self) -> tuple[dict[str, torch.Tensor], dict[str, str], int] | None:
        """The statistics keyed ``level_<γ>/<layer>.<sum|sumsq|count>``, their metadata and the bytes
        moved (the query's replies pulled now); None when no model needs them or nobody answered."""
        if not self.needed:
            return None
        nbytes = 0
        if self.query is not None:
            asked, nbytes = self.query.sums()
            self.found.update(zip(self.asked, asked))
        tensors: dict[str, torch.Tensor] = {}
        for level, sums in self.found.items():
            if sums is None:
                log(WARNING, "deployment statistics: no client answered for level %g; its export falls back", level)
                continue
            tensors.update({f"level_{level:g}/{k}": v for k, v in sums.items()})
        if not tensors:
            return None
        return tensors, {"source": "federated", "nodes_asked": str(len(asked_nodes_of(self.view))),
                         "examples_per_node": str(int(self.view.cfg.evaluation.bn_examples))}, nbytes
