"""Deployment statistics: the fixed norm statistics every level's exported model carries (static
BN), summed by the clients over their training data at the end of the run (the sBN query of
:class:`fedhm_flwr.server.bn_query.BnQuery`, every level's model in one message per node, at most
``evaluation.bn_examples`` examples a node).

The query is asked before the last round's evaluation on the server (:class:`DeploymentQuery`: the
nodes compute while the server evaluates) and read after it, unless that evaluation asks the nodes
for the same sums itself (``evaluation.bn_stats=federated``): then its sums are reused.

The run's **deployable accuracy** (:func:`deployable_figures`, the summary's
``final_deployable_acc/<global|level_γ>``) is each of these models scored on the server's test set
with exactly the statistics its export carries (docs/METHODS.md#deployable-statistics): the same
sums, installed by the same function (:func:`fedhm_flwr.models.deployable_network`) as ``fedhm
export``. The global model's sums are asked with the levels' (once, when a level's model is the global
one) but not saved: no export ships it.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import torch
from flwr.supercore import log

from fedhm_flwr.math.bn_stats import batch_statistics_layers, norm_layers
from fedhm_flwr.models import build_model, shape_device
from fedhm_flwr.server.bn_query import BnQuery, Sums, asked_nodes_of, spec_key
from fedhm_flwr.server.evaluation import distinct_models, score_all
from fedhm_flwr.server.methods.method import State


class DeploymentQuery:
    """The global model's and every level's deployable model (:func:`distinct_models`) that normalises
    with batch statistics, and its sums: those in ``known`` (by :func:`spec_key`, asked already by this
    model version's evaluation), the others asked now. ``view``: the round's
    :class:`fedhm_flwr.server.evaluation.RoundView`."""

    def __init__(self, view: Any, global_state: State, known: dict[str, Sums] | None = None) -> None:
        self.view = view
        self.models, self.keys = distinct_models(view.method, global_state)
        # False: no model needs fixed statistics (a frozen-backbone model: none normalises with its batch)
        self.needed = not any(spec.get("trainable_only") for spec, _ in self.models)
        self.found: dict[int, Sums | None] = {}  # index in models -> its sums (None: nobody answered)
        self.statistics: dict[int, str] = {}  # index -> which statistics its export carries
        ask: list[int] = []
        for index, (spec, _) in enumerate(self.models):
            with shape_device(spec):
                model = build_model(spec, spectral_init=False)
            if not self.needed or not batch_statistics_layers(model):
                self.statistics[index] = "running_averaged" if norm_layers(model) else "none"
                continue
            self.statistics[index] = "federated"
            self.found[index] = (known or {}).get(spec_key(spec))
            if self.found[index] is None:
                ask.append(index)
        self.asked = ask
        self.query = BnQuery(view, [self.models[i] for i in ask]) if ask else None
        self._read = False

    def result(self) -> tuple[dict[str, torch.Tensor], dict[str, str], int] | None:
        """The levels' statistics keyed ``level_<γ>/<layer>.<sum|sumsq|count>``, their metadata and the
        bytes moved (the query's replies pulled now); None when no model needs them or nobody answered."""
        nbytes = 0
        if self.query is not None and not self._read:
            asked, nbytes = self.query.sums()
            self.found.update(zip(self.asked, asked))
            self._read = True
        if not self.needed:
            return None
        tensors: dict[str, torch.Tensor] = {}
        for key, index in self.keys.items():
            sums = self.found.get(index)
            if index in self.found and sums is None:
                log(WARNING, "deployment statistics: no client answered for %s; its export falls back", key)
            elif sums is not None and key != "global":
                tensors.update({f"{key}/{k}": v for k, v in sums.items()})
        if not tensors:
            return None
        return (
            tensors,
            {
                "source": "federated",
                "nodes_asked": str(len(asked_nodes_of(self.view))),
                "examples_per_node": str(self.view.opts.evaluation.bn_examples),
            },
            nbytes,
        )


def deployable_figures(view: Any, query: DeploymentQuery) -> dict[str, Any]:
    """The row's ``deployable_acc/<key>`` and ``deployable_loss/<key>`` (``key``: ``global``,
    ``level_<γ>``): each model scored by the server's evaluation (``view.evaluate_fn``) with the
    statistics its export installs (the query's sums, :meth:`DeploymentQuery.result` read first), and
    ``deployable_bn_stats`` (which statistics, ``federated`` / ``running_averaged`` / ``none``). A
    model nobody gave sums for gets no figure (``deployable_missing`` names it); no test set on the
    server (``evaluation.where=clients``): nothing."""
    if view.evaluate_fn is None:
        return {}
    out: dict[str, Any] = {}
    missing = [key for key, index in query.keys.items() if index in query.found and query.found[index] is None]
    indices = sorted({i for key, i in query.keys.items() if key not in missing})
    figures = score_all(view.evaluate_fn, [(*query.models[i], query.found.get(i)) for i in indices])
    scored = dict(zip(indices, figures, strict=True))  # every model in one pass over the test set
    for key, index in query.keys.items():
        if key not in missing:
            out[f"deployable_acc/{key}"] = scored[index]["accuracy"]
            out[f"deployable_loss/{key}"] = scored[index]["loss"]
    out["deployable_bn_stats"] = (
        ",".join(sorted({query.statistics[i] for i in scored}))
        or "not measured: no client gave the deployment statistics"
    )
    if missing:
        out["deployable_missing"] = ",".join(missing)
    return out
