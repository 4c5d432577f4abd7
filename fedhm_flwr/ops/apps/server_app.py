"""ServerApp: compose and validate the config, build model, evaluator and strategy, run, write outputs.

Run-config keys (``pyproject.toml`` ``[tool.flwr.app.config]``): ``overrides`` (Hydra overrides,
one string), ``output-dir`` (absolute run directory) and ``resume`` (a run directory whose
checkpoint the run continues from).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import sys
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config import RunOptions, load_config, model_spec, resume_config, run_options, to_yaml
from fedhm_flwr.math.train import pick_device
from fedhm_flwr.models import build_model
from fedhm_flwr.ops.apps.superlink_watch import runtime_address, stop_with_superlink, watch_superlink
from fedhm_flwr.ops.deploy.device_run import note_superlink, on_devices
from fedhm_flwr.ops.job.health import judge
from fedhm_flwr.ops.job.procs import TAG_VAR
from fedhm_flwr.ops.job.runlock import RunLock
from fedhm_flwr.ops.tools.cost_table import size_warnings
from fedhm_flwr.reporting.provenance import code_version, recorded_version
from fedhm_flwr.reporting.results import (
    METRICS_JSONL,
    RunRecorder,
    load_checkpoint,
    load_checkpoint_state,
    refuse_existing_run,
    summarize,
    write_status,
)
from fedhm_flwr.reporting.startup import launcher_marks, parts_line, process_started_at, startup_parts
from fedhm_flwr.reporting.tracking import open_tracker
from fedhm_flwr.server.evaluation import make_evaluator
from fedhm_flwr.server.outputs import RunOutputs
from fedhm_flwr.server.registry import STRATEGIES

app = ServerApp()
#: when this process started (under ``flwr run``: the simulation process, which imports this module)
PROCESS_STARTED_AT = process_started_at()


def default_output_dir(method: str) -> Path:
    """``$FEDHM_OUTPUT_ROOT`` (else ``~/fedhm-outputs``) / date / time-method."""
    root = Path(os.environ.get("FEDHM_OUTPUT_ROOT", Path.home() / "fedhm-outputs")).expanduser()
    now = dt.datetime.now()
    return (root / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S-%f')}-{method}").resolve()


def initial_state(seed: int, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The initial global model of the run's ``seed``."""
    torch.manual_seed(int(seed))
    return {k: v.detach().clone() for k, v in build_model(spec).state_dict().items()}


def run(
    grid: Grid,
    cfg: DictConfig,
    out_dir: Path,
    resume: Path | None = None,
    opts: RunOptions | None = None,
    code: dict[str, Any] | None = None,
    main_at: float | None = None,
) -> dict[str, Any]:
    """One whole run of the validated config ``cfg`` (saved as the run's ``config.yaml``; ``opts``: its
    parsed options, parsed here when not given) on a grid; returns the summary (also written to ``out_dir``);
    ``code``: the code version it records (default: git's of the running code). The run
    directory is locked for the run (a second run into it is refused); under the launcher or
    deploy-local, which hold the lock already, the process carries their tag and goes in.
    When the SuperLink stops under it, the ServerApp records that and exits within seconds
    (:mod:`fedhm_flwr.ops.apps.superlink_watch`), freeing the lock for a resume."""
    opts = run_options(cfg) if opts is None else opts  # the options every part reads, parsed once
    lock = RunLock(out_dir, tag=os.environ.get(TAG_VAR)).acquire()
    address = runtime_address(sys.argv)
    note_superlink(out_dir, sys.argv, address)  # a run on devices says so: `fedhm resume` refuses it (#51)
    if address is not None:
        watch_superlink(
            address, lambda: stop_with_superlink(out_dir, opts.rounds, _rounds_done(out_dir), address, lock)
        )
    try:
        code = code or code_version()  # the code this run starts with (git may be absent: "unknown")
        write_status(out_dir, "running", rounds=opts.rounds, resumed=str(resume) if resume else None, **code)
        try:
            summary = _run(grid, cfg, opts, out_dir, resume, code, main_at)
        except BaseException as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
            write_status(
                out_dir, "failed", error=reason[:2000], rounds=opts.rounds, round=_rounds_done(out_dir), **code
            )
            raise
        health = judge(out_dir)  # what the run learned: a run in which nothing trained is a failure
        ended = summary.get("rounds_completed")
        if health.fatal:
            write_status(out_dir, "failed", error=health.error, rounds=opts.rounds, round=ended, **code)
        else:
            write_status(out_dir, "completed", rounds=opts.rounds, round=ended, **code)
        return summary
    finally:
        lock.release()


def _rounds_done(out_dir: Path) -> int:
    try:
        return len((out_dir / METRICS_JSONL).read_text().splitlines())
    except OSError:
        return 0


def _run(
    grid: Grid,
    cfg: DictConfig,
    opts: RunOptions,
    out_dir: Path,
    resume: Path | None,
    code: dict[str, Any] | None = None,
    main_at: float | None = None,
) -> dict[str, Any]:
    t0, started_at = time.perf_counter(), time.time()
    if resume is None:
        refuse_existing_run(out_dir)
    recorder = RunRecorder(out_dir, tracker=open_tracker(dataclasses.asdict(opts.tracking), out_dir))
    recorder.write_config(to_yaml(cfg))  # the run's config as saved; everything else reads opts
    spec = model_spec(cfg)
    # a deployment's server may hold no test set: with evaluation.where=clients none is loaded
    evaluator = None if opts.evaluation.where == "clients" else make_evaluator(opts, pick_device())
    strategy = STRATEGIES[opts.method.name](opts, spec, evaluator, RunOutputs(opts, recorder))
    if on_devices(sys.argv, runtime_address(sys.argv)):  # a device late after the last round may have died:
        strategy.wire.verdict_wait = opts.stragglers.verdict_seconds  # the run's end waits for the verdict
    for line in size_warnings(opts, spec):  # FedHM levels that do not shrink the model, before round 1
        log(WARNING, "warning: %s", line)
    state = strategy.method.initial_state(opts.seed)
    if state is None:
        state = initial_state(opts.seed, spec)
    if resume is not None:
        state, saved = load_checkpoint(resume)
        strategy.restore(saved)
        recorder.load_rows(saved.get("history", []))
        log(INFO, "resuming %s after round %d", resume, strategy.start_round - 1)
    log(
        INFO,
        "fedhm-flwr: %s on %s/%s, %d rounds, outputs in %s",
        opts.method.name,
        opts.model.arch,
        opts.dataset.name,
        opts.rounds,
        recorder.out_dir,
    )
    strategy.start(grid, ArrayRecord.from_torch_state_dict(state), num_rounds=opts.rounds, timeout=opts.timeout)
    costs = {f"{level:g}": strategy.method.level_cost(i) for i, level in enumerate(strategy.levels)}
    startup = startup_record(out_dir, strategy.startup_info, main_at or started_at)
    summary = summarize(
        recorder.rows,
        {
            "method": opts.method.name,
            "model": opts.model.arch,
            "dataset": opts.dataset.name,
            "levels": strategy.levels,
            "level_costs": costs,
            # what the last evaluation normalised with (final_acc/*; a running-statistics model: running_averaged)
            "bn_stats": next(
                (r["bn_stats"] for r in reversed(recorder.rows) if "bn_stats" in r), opts.evaluation.bn_stats
            ),
            # final_deployable_acc/*: the statistics the exported models carry, or why there is no such figure
            **deployable_label(opts, recorder.rows[-1] if recorder.rows else {}),
            **(code or {}),  # code_commit, code_dirty: the code the run started with
            "wall_seconds": time.perf_counter() - t0,
            "started_at": started_at,
            "finished_at": time.time(),  # wall clock (bench figure 8: the job's parts)
            "checkpoint_seconds": recorder.checkpoint_seconds,  # this session's checkpoint writing (bench figure 7)
            **startup,  # start-up: nodes learnt before round 1 (seconds, asked, bytes), its marks and parts
            "output_dir": str(recorder.out_dir),
            **strategy.untrusted.summary(),  # attack, defence and DP (epsilon) totals, when configured
        },
    )
    recorder.write_summary(summary)
    if summary["startup_parts"]:
        log(INFO, "fedhm-flwr: start-up: %s", parts_line(summary["startup_parts"]))
    recorder.plot(title=f"{opts.method.name} · {opts.model.arch} · {opts.dataset.name}")
    log(
        INFO,
        "fedhm-flwr: done; final accuracy: server test set %s, clients %s; outputs in %s",
        summary.get("final_acc/global"),
        summary.get("final_fed_acc/all"),
        recorder.out_dir,
    )
    return summary


def startup_record(out_dir: Path, info: dict[str, Any], main_at: float) -> dict[str, Any]:
    """The summary's start-up entries: the strategy's (seconds, nodes asked, bytes), ``startup_marks``
    (this process's start under a launcher, the ServerApp's start, its set-up's end, the first nodes'
    marks, round 1's start) and ``startup_parts`` (:func:`fedhm_flwr.reporting.startup.startup_parts`,
    with the launcher's marks when a launcher started the run)."""
    info = dict(info)
    launcher = launcher_marks(out_dir)
    marks = {
        **({"simulation_started_at": PROCESS_STARTED_AT} if launcher and PROCESS_STARTED_AT else {}),
        "serverapp_main_at": main_at,
        "startup_started_at": info.pop("startup_started_at", None),
        **info.pop("startup_marks", {}),
        "rounds_started_at": info.get("rounds_started_at"),
    }
    marks = {k: v for k, v in marks.items() if v is not None}
    return {**info, "startup_marks": marks, "startup_parts": startup_parts({**launcher, **marks})}


def deployable_label(opts: RunOptions, last: dict[str, Any]) -> dict[str, Any]:
    """``deployable_bn_stats``: the statistics behind the summary's ``final_deployable_acc/*`` (those
    the exported models carry, docs/METHODS.md#deployable-statistics), or ``not measured: <why>``."""
    if "deployable_bn_stats" in last:
        return {"deployable_bn_stats": last["deployable_bn_stats"]}
    why = (
        "evaluation.where=clients: the server holds no test set (the deployment statistics are saved; "
        "fedhm export scores the exported model where the test set is)"
        if opts.evaluation.where == "clients"
        else "evaluation.deploy_stats=false: no deployment statistics after the last round"
        if not opts.evaluation.deploy_stats
        else "the run did not reach its last round in this session"
    )
    return {"deployable_bn_stats": f"not measured: {why}"}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``."""
    main_at = time.time()  # the start-up's mark: the ServerApp starts (reporting/startup.py)
    run_config = context.run_config
    overrides = str(run_config.get("overrides", "") or "")
    resume = str(run_config.get("resume", "") or "") or None
    if resume:
        load_checkpoint_state(resume)  # FileNotFoundError naming the folder before anything is written there
    cfg = resume_config(resume, overrides) if resume else load_config(overrides)
    opts = run_options(cfg)
    out = resume or str(run_config.get("output-dir", "") or "") or opts.output_dir
    out_dir = Path(out).expanduser().resolve() if out else default_output_dir(opts.method.name)
    OmegaConf.update(cfg, "output_dir", str(out_dir))  # the saved config names where the run is
    opts = dataclasses.replace(opts, output_dir=str(out_dir))
    resumed = Path(resume).expanduser().resolve() if resume else None
    run(
        grid, cfg, out_dir, resumed, opts, recorded_version(dict(run_config)), main_at
    )  # the version staged with the app
