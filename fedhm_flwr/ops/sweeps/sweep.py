"""Hydra multirun sweeps: every job is one full run through ``flwr run`` on the simulation engine.

    python -m fedhm_flwr.ops.sweeps.sweep -m levels.ratios=[1,0.5,0.25,0.125],[1,0.25] method.tau=1,inf

Each job validates its configuration, then runs exactly what ``python -m fedhm_flwr.ops.job.launch``
runs (``flwr run`` on the sweep's SuperLink or its own, a status check, cleanup), writing its outputs into its
Hydra job directory (``outputs/multirun/<date>/<time>/job<N>/``), Flower's output into the job's
``flwr_run.log``, a progress line per job on the console (:mod:`fedhm_flwr.ops.job.progress`). When the
multirun ends, the :class:`SweepSummary` callback collects every job into ``summary.md``,
``summary.csv``, plots, and the statistics over seeds (``seed=0,1,2`` sweeps the seed like any
key), in the sweep directory (``python -m fedhm_flwr.reporting.summary`` does the same on demand).

Jobs run one after another (Hydra's basic launcher). Under ``fedhm sweep`` / ``fedhm compare`` they share
one SuperLink (:mod:`fedhm_flwr.ops.sweeps.shared_superlink`, handed down in ``FEDHM_SHARED_SUPERLINK_ADDRESS``;
``FEDHM_SHARED_SUPERLINK=0``: each starts its own on free ports); with ``FEDHM_SHARED_RAY=1`` also one Ray
instance (:mod:`fedhm_flwr.ops.sweeps.shared_ray`, handed down in ``FEDHM_SHARED_RAY_ADDRESS``), else each
starts its own.
Jobs may also run side by side with a parallel Hydra launcher (see the README).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config import validate
from fedhm_flwr.ops.job.outcome import (
    RunFailed,
    RunInterrupted,
    checkpoint_round,
    fedhm_commands,
    fedhm_program,
    report_stop,
)
from fedhm_flwr.ops.job.progress import run_with_progress
from fedhm_flwr.ops.job.signals import on_signals
from fedhm_flwr.ops.sweeps.multirun import (  # set by `fedhm sweep|compare --continue`; by compare for its sweeps
    CONTINUE_COMMAND_VAR,
    CONTINUE_VAR,
    QUIET_SUMMARY_VAR,
)
from fedhm_flwr.reporting.results import METRICS_CSV, METRICS_JSONL, SUMMARY_FILE
from fedhm_flwr.reporting.summary import console_report, write_summary


def continue_command(sweep_dir: Path) -> str:
    """What continues this sweep (``fedhm sweep --continue DIR``; a comparison's own command)."""
    return os.environ.get(CONTINUE_COMMAND_VAR) or shlex.join([*fedhm_program(), "sweep", "--continue", str(sweep_dir)])


def sweep_jobs(sweep_dir: Path) -> int | None:
    """How many jobs the sweep stored in ``sweep_dir`` has (its ``multirun.yaml``), None if unknown."""
    try:
        task = list(OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task)
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)
        return sum(len(batch) for batch in batches)
    except Exception:  # noqa: BLE001 - another sweeper's syntax: the count is only informative
        return None


def finished_jobs(sweep_dir: Path) -> list[str]:
    """The job folders of the sweep that hold a completed run (``summary.json``)."""
    return sorted(
        (p.name for p in sweep_dir.glob("job*") if (p / SUMMARY_FILE).is_file()),
        key=lambda name: int(name[3:]) if name[3:].isdigit() else 0,
    )


def sweep_report(sweep_dir: Path, job: str, what: str) -> str:
    """Which jobs finished, which one stopped (``what``), how many were not started, and the
    command that runs only the missing ones."""
    done = finished_jobs(sweep_dir)
    total = sweep_jobs(sweep_dir)
    left = "" if total is None else f"; not started: {max(0, total - len(done) - 1)}"
    return (
        f"sweep {sweep_dir}: finished: {', '.join(done) or 'none'}; {what}: {job}{left}\n"
        f"continue the sweep (finished jobs are kept, {job} resumes from its checkpoint) with:\n"
        f"  {continue_command(sweep_dir)}"
    )


@hydra.main(config_path="../../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """One sweep job: validate, run through ``flwr run``, return the final global accuracy on the
    server's test set (the clients' federated accuracy when the server has none).

    In a continued sweep (``fedhm sweep --continue``) a job whose folder holds a completed run is
    kept as it is, one with a checkpoint resumes from it, any other starts again. An interrupt
    or a failure ends the sweep after the job's cleanup, saying which jobs finished and how to
    continue (exit 128 + the signal, or 1)."""
    validate(cfg)
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir).resolve()
    sweep_dir = Path(hc.sweep.dir).resolve()
    label = f"job {hc.job.num}: "
    resume = None
    if os.environ.get(CONTINUE_VAR):
        if (job_dir / SUMMARY_FILE).is_file():
            summary = json.loads((job_dir / SUMMARY_FILE).read_text())
            print(f"{label}finished in an earlier session: kept ({job_dir})", flush=True)
            return _accuracy(summary)
        if checkpoint_round(job_dir) is not None:
            resume = job_dir
        else:  # rounds without a checkpoint cannot be continued: the job starts again
            for name in (METRICS_JSONL, METRICS_CSV):
                (job_dir / name).unlink(missing_ok=True)
    try:
        summary = run_with_progress(
            [] if resume else list(hc.overrides.task),
            run_dir=None if resume else job_dir,
            resume=resume,
            label=label,
            commands=fedhm_commands(),
        )
    except RunInterrupted as stop:
        print(
            f"\n{label}{str(stop).splitlines()[0]}\n{sweep_report(sweep_dir, job_dir.name, 'interrupted')}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(stop.exit_code) from None
    except RunFailed as err:
        print(f"\n{label}error: {err}\n{sweep_report(sweep_dir, job_dir.name, 'failed')}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return _accuracy(summary)


def _accuracy(summary: dict[str, Any]) -> float | None:
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
        print(
            f"\nSweep summary ({len(rows)} jobs) in {sweep_dir}/summary.md, statistics over seeds in "
            f"{sweep_dir}/statistics.md\n",
            flush=True,
        )
        if not os.environ.get(QUIET_SUMMARY_VAR):  # a comparison prints its own tables, once
            print(console_report(rows, sweep_dir), end="", flush=True)


if __name__ == "__main__":
    try:
        with on_signals():  # an interrupt between jobs (Hydra's own work) ends the sweep cleanly too
            main()
    except KeyboardInterrupt as stop:
        sys.exit(report_stop(stop))
