"""A whole run in this process, with the numbers of the same job through `flwr run` (tests/test_lifecycle.py,
tests/test_deployable.py): the ServerApp's ``run`` on the in-process grid with the project's client
handlers, without Flower's start-up (~20 s a run here).

The client handlers set torch's thread count (``simulation.num_cpus``, as in a ClientApp process); the
in-process grid puts the server's back after each (:class:`LocalGrid`), and the run here computes on
torch's default count, a ServerApp process's: the run is bit-identical to a `fedhm run` of the job
(checked: the CNN job of tests/test_lifecycle.py, the shufflenet job of tests/test_deployable.py).
That default is the machine's core count (or ``OMP_NUM_THREADS``), and the server's SVDs and
reductions round differently with it: a test whose numbers must not depend on the machine fixes the
server's count (``server_threads``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from fedhm_flwr.config import load_config
from fedhm_flwr.ops.apps.local_grid import Handler, LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run

#: a small job, the methods' short runs: 4 nodes, every node training in each of 2 rounds, iid
#: partitions, a width-8 model
SMALL_JOB = (
    "num_clients=4",
    "fraction_train=1.0",
    "rounds=2",
    "model.width=8",
    "train.batch_size=32",
    "partition.scheme=iid",
)

#: torch's thread count in a fresh process (read when the tests are collected, before any test ran a
#: client handler in this process): what a ServerApp process computes with
SERVER_THREADS = torch.get_num_threads()


def run_in_process(
    cfg: DictConfig, run_dir: Path, handlers: dict[str, Handler] | None = None, server_threads: int | None = None
) -> dict[str, Any]:
    """Run the job ``cfg`` (``cfg.num_clients`` nodes) into ``run_dir``; its summary. The server's
    side computes on ``server_threads`` threads (default :data:`SERVER_THREADS`: this machine's
    `fedhm run`; a fixed count: the same numbers on every machine with the same kernels, whatever
    its core count). This process's thread count is put back afterwards."""
    grid = LocalGrid(int(cfg.num_clients), handlers or client_handlers())
    before = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS if server_threads is None else server_threads)
    try:
        return run(grid, cfg, run_dir)
    finally:
        torch.set_num_threads(before)


def small_run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """The summary of :data:`SMALL_JOB` with ``overrides`` (the method, its levels, the data's sizes),
    run here (:func:`run_in_process`); every round must have completed."""
    cfg = load_config([*SMALL_JOB, *overrides])
    summary = run_in_process(cfg, run_dir)
    assert summary["rounds_completed"] == int(cfg.rounds), summary
    return summary
