"""Hydra multirun sweeps: every job is one full run through ``flwr run`` on the simulation engine.

    python -m fedhm_flwr.sweep -m levels.ratios=[1,0.5,0.25,0.125],[1,0.25] method.tau=1,inf

Each job validates its configuration, then runs exactly what ``python -m fedhm_flwr.launch``
runs (a private SuperLink, ``flwr run``, a status check, cleanup), writing its outputs into its
Hydra job directory (``outputs/multirun/<date>/<time>/job<N>/``), Flower's output into the job's
``flwr_run.log``, a progress line per job on the console (:mod:`fedhm_flwr.progress`). When the
multirun ends, the :class:`SweepSummary` callback collects every job into ``summary.md``,
``summary.csv``, plots, and the statistics over seeds (``seed=0,1,2`` sweeps the seed like any
key), in the sweep directory (``python -m fedhm_flwr.summary`` does the same on demand).

Jobs run one after another (Hydra's basic launcher). Each job starts its own SuperLink on free
ports and its own Ray instance, so jobs may also run side by side with a parallel Hydra launcher
(see the README).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fedhm_flwr.config import validate
from fedhm_flwr.progress import run_with_progress
from fedhm_flwr.summary import markdown_table, write_summary


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """One sweep job: validate, run through ``flwr run``, return the final global accuracy on the
    server's test set (the clients' federated accuracy when the server has none)."""
    validate(cfg)
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir).resolve()
    summary = run_with_progress(list(hc.overrides.task), run_dir=job_dir, label=f"job {hc.job.num}: ")
    acc = summary.get("final_acc/global")
    return summary.get("final_fed_acc/all") if acc is None else acc


class SweepSummary(Callback):
    """Writes the sweep's table and plots into the sweep directory when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        try:
            rows = write_summary([sweep_dir], sweep_dir)
        except FileNotFoundError as err:
            print(f"sweep summary: {err}", file=sys.stderr)
            return
        print(f"\nSweep summary ({len(rows)} jobs) in {sweep_dir}/summary.md, statistics over seeds in "
              f"{sweep_dir}/statistics.md\n")
        print(markdown_table(rows))
        print((sweep_dir / "statistics.md").read_text())


if __name__ == "__main__":
    main()
