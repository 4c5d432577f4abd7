"""What a run keeps of its rounds, apart from the round: the ServerApp's (as in Flower's template,
where the strategy runs the rounds and the ServerApp saves the model).

The strategy (:class:`fedhm_flwr.server.strategy.HeteroStrategy`) orchestrates the rounds and
tells one listener (:class:`RoundOutputs`) three moments of each round, handing it a
:class:`RoundEnd` (never itself): the model is merged (``trained``), the round is evaluated
(``evaluated``: its row may still take figures), the row is closed and kept in the history
(``closed``); and, when the SuperLink's verdict on a node an earlier round recorded late comes later
(:mod:`~fedhm_flwr.server.late`), that round's amended row (``amended``), and, when that happened
after the last round, the last round once more (``settled``: its checkpoint holds the amended
history). :class:`RunOutputs`, which the ServerApp builds, writes the row (rewritten when amended),
the checkpoint (``checkpoint.every``, the last round), the best model (``checkpoint.keep_best``)
and, after the last round, every level's deployment statistics (``evaluation.deploy_stats``,
docs/METHODS.md#deployable-statistics).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.server import deployment, evaluation as ev
from fedhm_flwr.server.methods.method import State


@dataclass
class RoundEnd:
    """What the round hands its outputs: the round, the merged global model, what the evaluation
    is given of the round (:class:`fedhm_flwr.server.evaluation.RoundView`) and the checkpoint's state."""

    server_round: int
    num_rounds: int
    state: State
    view: ev.RoundView
    checkpoint_state: Callable[[], dict[str, Any]]
    #: the norm sums the round's server evaluation asked the clients for (set once it has run)
    known: dict[str, Any] | None = None

    @property
    def last(self) -> bool:
        return self.server_round == self.num_rounds


class RoundOutputs(Protocol):
    """The round's one listener (see the module docstring)."""

    def trained(self, end: RoundEnd) -> None: ...

    def evaluated(self, end: RoundEnd, row: dict[str, Any]) -> None: ...

    def closed(self, end: RoundEnd, row: dict[str, Any]) -> None: ...

    def amended(self, server_round: int, row: dict[str, Any]) -> None: ...

    def settled(self, end: RoundEnd) -> None: ...


class RunOutputs:
    """Rows, checkpoints, the best model and the deployment statistics of a run, written by a
    recorder (:class:`fedhm_flwr.reporting.results.RunRecorder`)."""

    def __init__(self, opts: RunOptions, recorder: Any) -> None:
        self.recorder = recorder
        self.every = opts.checkpoint.every
        self.keep_best = opts.checkpoint.keep_best
        self.deploy_stats = opts.evaluation.deploy_stats  # every level's statistics after the last round
        self.ask_early = opts.evaluation.bn_stats != "federated"
        self._early: deployment.DeploymentQuery | None = None

    def trained(self, end: RoundEnd) -> None:
        """After the last round, the deployment statistics are asked now: the nodes sum while the
        server evaluates (with federated statistics the evaluation's own sums are reused instead)."""
        wanted = end.last and self.deploy_stats and self.ask_early
        self._early = deployment.DeploymentQuery(end.view, end.state) if wanted else None

    def evaluated(self, end: RoundEnd, row: dict[str, Any]) -> None:
        if end.last and self.deploy_stats:
            self._save_deployment_statistics(end, row)

    def closed(self, end: RoundEnd, row: dict[str, Any]) -> None:
        self.recorder.log_round(row)
        if end.last or (self.every > 0 and end.server_round % self.every == 0):
            self.recorder.save_checkpoint(end.state, end.checkpoint_state())
        if self.keep_best:
            self.recorder.save_best(end.state, row)

    def amended(self, server_round: int, row: dict[str, Any]) -> None:
        """An earlier round's row, amended: the tables are rewritten with it."""
        self.recorder.amend_round(server_round, row)

    def settled(self, end: RoundEnd) -> None:
        """Rows were amended after the last round (``end``): its checkpoint, written when the round closed,
        is written again, so the history it holds (what a resume or ``fedhm status`` reads) is the amended one."""
        self.recorder.save_checkpoint(end.state, end.checkpoint_state())

    def _save_deployment_statistics(self, end: RoundEnd, row: dict[str, Any]) -> None:
        """The fixed norm statistics of every level's deployable model (the clients' sBN sums; asked
        early or now, reusing what the final evaluation asked), saved beside the final checkpoint
        for ``fedhm export``, and each model's accuracy with them (docs/METHODS.md#deployable-statistics)."""
        t0 = time.perf_counter()
        found = (query := self._early or deployment.DeploymentQuery(end.view, end.state, end.known)).result()
        row["deploy_stats_seconds"] = time.perf_counter() - t0  # what the query took past the evaluation
        if found is not None:
            tensors, metadata, nbytes = found
            self.recorder.save_bn_statistics(tensors, {**metadata, "round": str(end.server_round)})
            row["bytes_bn_stats"] = row.get("bytes_bn_stats", 0) + nbytes
        row.update(deployment.deployable_figures(end.view, query))  # scored as exported
        self._early = None
