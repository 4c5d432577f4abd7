"""Run one job through ``flwr run`` on Flower's Ray-backed simulation engine, safely.

``python -m fedhm_flwr.ops.job.launch [HYDRA OVERRIDES ...]`` (what ``make run`` calls):

1. composes and validates the Hydra config and checks the run's data (a bad value or missing
   data stops here, exit 2, before anything starts);
2. locks the run directory (``<run dir>/.lock``): a second launch into a directory that a live
   run is using is refused (exit 2), naming the directory and the live PID;
3. starts a watchdog (``fedhm_flwr.ops.job.procs``) and a private SuperLink in simulation mode on a free
   loopback port, with its own ``FLWR_HOME`` inside the run directory and runtime dependency
   installation disabled; every process started carries the job's tag. A job of a sweep joins the
   SuperLink its sweep hands down instead (:mod:`fedhm_flwr.ops.sweeps.shared_superlink`) and stops
   its own run's processes there when it ends;
4. stages the app's own files (packages, Hydra tree, metadata) next to the run and runs
   ``flwr run <staged app> <connection> --stream`` with the overrides and the absolute run
   directory as run-config, and ``num-supernodes`` / client resources from the config;
5. reads its own run id from ``flwr run``'s output and judges the run by that id's final status
   (``flwr list --run-id <id> --format json``; ``--stream`` exits 0 even when a run failed) and
   by a summary written by this run;
6. stops every process it started (SuperLink, SuperExec, ``flwr-simulation``, Ray), also on
   failure (:class:`RunFailed`, whose last line names the first ServerApp / client error). On
   Ctrl-C / SIGTERM / SIGHUP it first stops the Flower run (``flwr stop <id>``), keeps the last
   complete checkpoint and raises :class:`RunInterrupted` with the command that resumes the run
   (in the caller's terms, :class:`Commands`); this module prints it and exits 128 + the signal
   number (130 for Ctrl-C, 143 for SIGTERM). If the launcher is killed outright, the watchdog
   stops everything within seconds.

The pieces live beside it: the SuperLink and the app bundle in :mod:`fedhm_flwr.ops.job.superlink`, the
``flwr run`` runner in :mod:`fedhm_flwr.ops.job.flower_job`, how a run ends (resume commands,
:class:`RunInterrupted`, :class:`RunFailed`) in :mod:`fedhm_flwr.ops.job.outcome`; ``fedhm deploy-local``
(:mod:`fedhm_flwr.ops.deploy.deploy_local`) shares all three.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fedhm_flwr.config import (
    RunOptions,
    compose_config,
    data_spec,
    load_config,
    resume_config,
    run_options,
    split_overrides,
)
from fedhm_flwr.data.files import check_data_available
from fedhm_flwr.data.sources import check_partitions
from fedhm_flwr.ops.job.flower_job import ErrorScan, FlowerJob, run_flower_job
from fedhm_flwr.ops.job.outcome import (
    Commands,
    PythonCommands,
    RunFailed,
    RunInterrupted,
    checkpoint_round,
    fedhm_commands,
    fedhm_program,
    interrupted,
    report_finished,
    report_stop,
    require_checkpoint,
    require_local_run,
    resume_hint,
    run_command,
)
from fedhm_flwr.ops.job.procs import Processes, new_tag
from fedhm_flwr.ops.job.runlock import RunLock
from fedhm_flwr.ops.job.signals import Interrupted, on_signals
from fedhm_flwr.ops.job.superlink import (
    APP_DIR,
    SIMULATION_CONNECTION,
    free_port,
    stage_app,
    start_simulation_superlink,
    superlink_env,
    write_run_config,
)
from fedhm_flwr.ops.sweeps.shared_ray import SHARED_RAY_VAR
from fedhm_flwr.ops.sweeps.shared_superlink import HandedDown, end_run, handed_down
from fedhm_flwr.reporting.results import refuse_existing_run
from fedhm_flwr.reporting.startup import TIMINGS_FILE, process_started_at, startup_parts

#: names other modules and tests import from here (the launcher's public face)
__all__ = [
    "Commands",
    "ErrorScan",
    "PythonCommands",
    "RunFailed",
    "RunInterrupted",
    "check_data",
    "checkpoint_round",
    "default_run_dir",
    "fedhm_commands",
    "fedhm_program",
    "free_port",
    "main",
    "report_stop",
    "require_checkpoint",
    "resume_hint",
    "run_job",
    "superlink_env",
]

# ``<run dir>/timings.json`` (TIMINGS_FILE): when each part of a launched job's start-up and end happened (wall
# clock, ``time.time()``; the ServerApp's own marks are in the summary's ``startup_marks``), and the start-up's
# parts (``startup_parts``); bench figures 8 and 10 break the job down

LAUNCH = (sys.executable, "-m", "fedhm_flwr.ops.job.launch")
#: the process's start, a mark of the first job this process launches only (``fedhm run``: Python's start
#: and the imports are its start-up's first part; the later jobs of a sweep start from their own launch)
_PROCESS_MARK = {"launcher_process_started_at": process_started_at()}
LAUNCH_COMMANDS = Commands((*LAUNCH, "--resume"), LAUNCH, APP_DIR)


def default_run_dir(method: str) -> Path:
    """``outputs/<date>/<time>-<method>`` in the folder the command runs in (as Hydra's own runs), or
    under ``$FEDHM_OUTPUT_ROOT``; the console names it when the run starts."""
    root = Path(os.environ.get("FEDHM_OUTPUT_ROOT", Path.cwd() / "outputs")).expanduser()
    now = dt.datetime.now()
    return (root / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S-%f')}-{method}").resolve()


def check_data(cfg: DictConfig, simulation: bool = True) -> None:
    """The run's data is there (raises ConfigError naming the setting and the fix): the server's
    test set and, in simulation, the clients' source; a deployment's nodes check their own shard."""
    check_data_available(cfg, simulation=simulation)


def check_training_data(cfg: DictConfig) -> None:
    """The simulated nodes can learn from the validated config's data: at least 2 classes, and a
    partition for every node, computed as the nodes compute it (ConfigError naming the fields)."""
    check_partitions(data_spec(cfg))


def run_job(
    overrides: list[str],
    run_dir: Path | None = None,
    resume: Path | None = None,
    quiet: bool = False,
    commands: Commands | None = None,
    on_error: Callable[[str], None] | None = None,
    on_checked: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Validate, run through ``flwr run``, verify; returns the run's summary.

    Raises ConfigError / FileExistsError (incl. RunDirectoryBusy) before anything starts,
    :class:`RunFailed` when the run fails and :class:`RunInterrupted` (after the cleanup) on
    SIGINT / SIGTERM / SIGHUP; their resume command is in ``commands``' terms (default:
    ``python -m fedhm_flwr.ops.job.launch --resume DIR``). ``on_error`` is told the run's first ServerApp
    error and first client error (one line each) as soon as Flower's output shows them; ``on_checked``
    is called once the config and the data are accepted, before anything starts."""
    commands = commands or LAUNCH_COMMANDS
    marks = {"launcher_started_at": time.time()}  # (timings.json; measurement only)
    first = {k: v for k, v in _PROCESS_MARK.items() if v is not None}
    _PROCESS_MARK.clear()
    marks = {**first, **marks}
    if resume is not None:
        resume = resume.resolve()
        require_local_run(resume)  # a run on devices resumes there, not here
        require_checkpoint(resume)  # before anything else: a resume without a checkpoint is refused at once
    # refuse missing data and bad values before anything starts (the data check first: it needs no torch)
    if resume is None:
        check_data(compose_config(overrides))
    cfg = resume_config(resume, overrides) if resume is not None else load_config(overrides)
    check_data(cfg)  # (FedHM levels that do not shrink the model: warned by the ServerApp, which has torch)
    check_training_data(cfg)  # reads the labels and partitions them: after the cheap checks
    opts = run_options(cfg)
    marks["checked_at"] = time.time()
    if on_checked is not None:
        on_checked()
    if resume is not None:
        run_dir = resume
    run_dir = (run_dir or (Path(opts.output_dir) if opts.output_dir else default_run_dir(opts.method.name))).resolve()
    tag = new_tag()
    # the config's cluster, else the sweep's shared Ray instance (ops/sweeps/shared_ray.py), else a private one
    ray_address = opts.simulation.ray_address or os.environ.get(SHARED_RAY_VAR) or None
    shared = handed_down(ray_address)  # the sweep's SuperLink (ops/sweeps/shared_superlink.py), if it serves it
    with on_signals():
        try:
            # before anything starts; refuses a directory in use. The ServerApp runs under the job's tag,
            # or under the shared SuperLink's: both may enter
            with RunLock(run_dir, tag, guests=(shared.tag,) if shared else ()) as lock:
                if resume is None:
                    refuse_existing_run(run_dir)
                else:
                    require_checkpoint(run_dir)
                with Processes(tag, keep_fds=[lock.fd] if lock.fd is not None else []) as procs:
                    summary = _run(
                        procs, opts, overrides, run_dir, resume, quiet, commands, on_error, marks, ray_address, shared
                    )
                marks["cleaned_up_at"] = time.time()  # every process the job started has ended
                parts = startup_parts({**marks, **summary.get("startup_marks", {})})
                (run_dir / TIMINGS_FILE).write_text(json.dumps({**marks, "startup_parts": parts}, indent=1) + "\n")
                return summary
        except Interrupted as stop:
            raise interrupted(stop, run_dir, commands, overrides if resume is None else []) from None


def _run(
    procs: Processes,
    opts: RunOptions,
    overrides: list[str],
    run_dir: Path,
    resume: Path | None,
    quiet: bool,
    commands: Commands,
    on_error: Callable[[str], None] | None = None,
    marks: dict[str, float] | None = None,
    ray_address: str | None = None,
    shared: HandedDown | None = None,
) -> dict[str, Any]:
    """The job's Flower side: a SuperLink (its own, or ``shared``, the sweep's), ``flwr run``, its outcome.
    Its clients run on the Ray cluster at ``ray_address`` (None: a private Ray instance)."""
    marks = {} if marks is None else marks
    flwr_home = run_dir / ".flwr"
    run_config = write_run_config(flwr_home / "run_config.toml", overrides, run_dir, resume)
    federation = (
        f'num-supernodes={opts.num_clients} backend="ray" '
        f"client-resources-num-cpus={max(1, int(opts.simulation.num_cpus))} "
        f"client-resources-num-gpus={opts.simulation.num_gpus} "
        'init-args-logging-level="ERROR" init-args-log-to-driver=true'
    )
    if shared is None:
        env = start_simulation_superlink(procs, flwr_home, run_dir / "superlink.log", ray_address=ray_address)
    else:
        env = shared.connect(flwr_home)
    marks["superlink_ready_at"] = time.time()
    app = stage_app(flwr_home / "app")
    marks["app_staged_at"] = time.time()
    (run_dir / TIMINGS_FILE).write_text(json.dumps(marks, indent=1) + "\n")  # the ServerApp reads them
    job = FlowerJob(
        procs,
        env,
        SIMULATION_CONNECTION,
        run_dir / "flwr_run.log",
        echo=not quiet,
        on_error=on_error,
        run_tag=shared.tag if shared else None,
    )
    ended = False
    try:
        summary = run_flower_job(
            job,
            app,
            run_config,
            run_dir,
            ["--federation-config", federation],
            see=f" and {run_dir}/superlink.log" if shared is None else "",
            commands=commands,
        )
        ended = True
        return summary
    finally:
        marks.update(job.marks)
        if shared is not None:  # the run's processes on the shared SuperLink are this job's to stop
            end_run(shared.tag, settle=10.0 if ended else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedhm_flwr.ops.job.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method.tau=2 levels.ratios=[1,0.5]")
    parser.add_argument("--run-dir", type=Path, help="absolute run directory (default: outputs/<date>/<time>-<method>)")
    parser.add_argument("--resume", type=Path, help="continue the run stored in this run directory")
    args = parser.parse_args(argv)
    code, summary = run_command(lambda: run_job(split_overrides(args.overrides), args.run_dir, args.resume))
    if summary is None:
        return code
    return report_finished(summary)


if __name__ == "__main__":
    sys.exit(main())
