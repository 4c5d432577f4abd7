"""Hydra multiruns as child processes: ``fedhm sweep`` and ``fedhm compare``.

A sweep runs ``python -m fedhm_flwr.ops.sweeps.sweep -m OVERRIDES`` in a process group of its own (Hydra
finds its config tree relative to that entry point and owns the process while the multirun
lasts); ``fedhm compare`` plans one sweep per method set and ablation (:func:`compare_plan`),
runs them in turn and summarises them. An interrupted sweep or comparison continues with
``--continue DIR``: finished jobs are kept, the interrupted one resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from omegaconf import OmegaConf

from fedhm_flwr.config import ConfigError, split_overrides
from fedhm_flwr.ops.job.outcome import fedhm_program
from fedhm_flwr.ops.job.signals import SIGNALS
from fedhm_flwr.ops.sweeps.shared_ray import SHARED_RAY_VAR, enabled as shared_ray_enabled, shared_ray
from fedhm_flwr.ops.sweeps.shared_superlink import (
    SHARED_SUPERLINK_VAR,
    enabled as shared_superlink_enabled,
    shared_superlink,
)
from fedhm_flwr.reporting.summary import main as summary_main

#: `fedhm compare` (`make compare`): the baselines on the same work, every method on every seed,
#: then one FedHM sweep per ablation; about 5 min per run on 2 cores (24 runs with 3 seeds)
COMPARE_METHODS = "fedhm,heterofl,fedrolex,fedavg,fedavg_smallest"
COMPARE_OVERRIDES = ("rounds=8", "dataset.max_train_examples=30000")
COMPARE_SEEDS = "0,1,2"
COMPARE_MATCH = "fedhm_params"
#: levels.match values of a budget-matched comparison -> what FedHM's level is matched on
MATCH_WORDS = {"fedhm_params": "parameter count", "fedhm_macs": "MACs per input", "fedhm_memory": "training memory"}


def match_option(value: str) -> str:
    """``--match``: ``params``, ``macs``, ``memory`` (or with levels.match's ``fedhm_`` prefix) or ``none``."""
    match = value if value == "none" or value.startswith("fedhm_") else f"fedhm_{value}"
    if match != "none" and match not in MATCH_WORDS:
        raise argparse.ArgumentTypeError(f"{value!r}; allowed: params, macs, memory, none")
    return match


COMPARE_ABLATIONS = ("train.distill.enabled=true", "method.official_weights=true", "method.add_previous_global=true")


#: set for a sweep that continues an interrupted one: its finished jobs are kept, an interrupted job
#: is resumed from its checkpoint (fedhm_flwr/ops/sweeps/sweep.py)
CONTINUE_VAR = "FEDHM_SWEEP_CONTINUE"
#: what an interrupted sweep prints as the command that continues it (compare: ``fedhm compare --continue``)
CONTINUE_COMMAND_VAR = "FEDHM_CONTINUE_COMMAND"
#: set for the sweeps of a comparison: a sweep names its tables without printing them (the comparison
#: prints its own, once, over every sweep)
QUIET_SUMMARY_VAR = "FEDHM_SWEEP_QUIET_SUMMARY"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the sweep process gets SIGTERM when `fedhm` dies, even by SIGKILL (then it stops its job)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM


def _hydra_sweep(overrides: list[str], env: dict[str, str] | None = None) -> int:
    """``python -m fedhm_flwr.ops.sweeps.sweep -m OVERRIDES``, as its own process: Hydra finds its config tree
    relative to the entry point's file and owns the process while the multirun lasts.

    The sweep runs in a process group of its own and this process forwards SIGINT / SIGTERM /
    SIGHUP to it, once (a terminal's Ctrl-C reaches only this foreground group); the sweep stops
    its job, says which jobs finished and how to continue, and exits 128 + the signal, which is
    this command's exit code."""
    cmd = [
        sys.executable,
        "-m",
        "fedhm_flwr.ops.sweeps.sweep",
        "-m",
        *[o for o in overrides if o not in ("-m", "--multirun")],
    ]
    # process_group= is Python >= 3.11 (mypy checks for 3.10, the oldest requires-python admits): on 3.10
    # this call raises TypeError, a gap to close in the code, not here
    proc = subprocess.Popen(  # type: ignore[call-overload]
        cmd,
        env={**os.environ, **(env or {})},
        process_group=0,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    sent: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not sent:
            sent.append(signum)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
        else:
            print(
                f"{signal.Signals(signum).name} received: the sweep is still stopping its job, please wait",
                file=sys.stderr,
                flush=True,
            )

    previous = {sig: signal.signal(sig, forward) for sig in SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    if code < 0:  # killed by a signal it did not handle
        code = 128 - code
    return code


@contextlib.contextmanager
def sweep_ray(overrides: list[str]) -> Iterator[dict[str, str]]:
    """The environment that gives a sweep's jobs one shared Ray instance (:mod:`fedhm_flwr.ops.sweeps.shared_ray`),
    started here and stopped when the block ends; none (``{}``) where ``FEDHM_SHARED_RAY=0``, where the
    overrides name ``simulation.ray_address`` or where a shared instance is already handed down."""
    if (
        not shared_ray_enabled()
        or os.environ.get(SHARED_RAY_VAR)
        or any(_key(o) == "simulation.ray_address" for o in overrides)
    ):
        yield {}
        return
    with shared_ray() as address:
        yield {SHARED_RAY_VAR: address}


@contextlib.contextmanager
def sweep_services(overrides: list[str]) -> Iterator[dict[str, str]]:
    """What the jobs of a sweep (or of every sweep of a comparison) share, started here and stopped when
    the block ends: the environment handing it down. A Ray instance where :func:`sweep_ray` says so; one
    SuperLink (:mod:`fedhm_flwr.ops.sweeps.shared_superlink`) unless ``FEDHM_SHARED_SUPERLINK=0``, the
    overrides name ``simulation.ray_address`` or a Hydra launcher (jobs side by side), or one is handed down."""
    with sweep_ray(overrides) as ray_env:
        if (
            not shared_superlink_enabled()
            or os.environ.get(SHARED_SUPERLINK_VAR)
            or any(_key(o) in ("simulation.ray_address", "hydra/launcher") for o in overrides)
        ):
            yield ray_env
            return
        with shared_superlink(ray_env.get(SHARED_RAY_VAR) or os.environ.get(SHARED_RAY_VAR) or None) as link_env:
            yield {**ray_env, **link_env}


def _sweep_continuation(sweep_dir: Path) -> list[str]:
    """The overrides that run the sweep stored in ``sweep_dir`` again, into the same directory:
    its task overrides and its Hydra overrides (launcher, ...) from Hydra's ``multirun.yaml``."""
    saved = sweep_dir / "multirun.yaml"
    if not saved.is_file():
        raise ConfigError(
            "--continue",
            str(sweep_dir),
            "a sweep directory holding Hydra's multirun.yaml (the folder an interrupted sweep named)",
        )
    cfg = OmegaConf.load(saved)
    hydra_overrides = [o for o in cfg.hydra.overrides.hydra if _key(o) not in ("hydra.mode", "hydra.sweep.dir")]
    return [*cfg.hydra.overrides.task, *hydra_overrides, f"hydra.sweep.dir={sweep_dir}"]


def _sweep_help(parser: argparse.ArgumentParser) -> int:
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides; comma-separated values are swept "
        "(`-m` is implied), hydra/launcher=... picks a Hydra launcher",
    )
    parser.print_help()
    return 0


def cmd_sweep(argv: list[str], parser: argparse.ArgumentParser) -> int:
    """``fedhm sweep`` (``parser``: the command's, for ``--help``)."""
    if {"-h", "--help"} & set(argv):
        return _sweep_help(parser)
    if argv and argv[0] == "--continue":
        if len(argv) != 2:
            print("error: usage: fedhm sweep --continue <sweep dir>", file=sys.stderr)
            return 2
        try:
            overrides = _sweep_continuation(Path(argv[1]).resolve())
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        with sweep_services(overrides) as shared:
            return _hydra_sweep(overrides, {CONTINUE_VAR: "1", **shared})
    with sweep_services(argv) as shared:
        return _hydra_sweep(argv, shared)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compare_plan(
    user: list[str],
    seeds: str = COMPARE_SEEDS,
    match: str = COMPARE_MATCH,
    ablations: tuple[str, ...] = COMPARE_ABLATIONS,
    now: dt.datetime | None = None,
) -> tuple[str, list[list[str]]]:
    """(compare directory, one sweep's overrides per sweep): the methods on every seed, then plain
    FedHM with each ablation on the same seeds. The user's overrides replace a default with the
    same key (``method=...`` the method list, ``hydra.sweep.dir=...`` the directory)."""
    stamp = (now or dt.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    given = {_key(o): o for o in user}
    root = given.pop("hydra.sweep.dir", f"hydra.sweep.dir=outputs/compare/{stamp}").split("=", 1)[1]
    methods = given.pop("method", f"method={COMPARE_METHODS}")
    rest = [o for o in COMPARE_OVERRIDES if _key(o) not in given] + [o for o in user if _key(o) in given]
    common = [f"seed={seeds}", f"levels.match={match}", *rest]
    sweeps = [[methods, *common, f"hydra.sweep.dir={root}/methods"]]
    for option in ablations:
        sweeps.append(["method=fedhm", option, *common, f"hydra.sweep.dir={root}/{_key(option)}"])
    return root, sweeps


def cmd_compare(argv: list[str], parser: argparse.ArgumentParser) -> int:
    """``fedhm compare`` (``parser``: the command's, options are added here)."""
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides of every run (rounds=3, method=fedhm,heterofl ...)"
    )
    parser.add_argument("--seeds", default=COMPARE_SEEDS, help=f"comma-separated seeds (default {COMPARE_SEEDS})")
    parser.add_argument(
        "--match",
        default=COMPARE_MATCH,
        type=match_option,
        help="the resource HeteroFL/FedRolex/FjORD widths (and, on params, FIARSE's sizes) match FedHM's "
        "levels on: params (bytes on the "
        "wire), macs (compute), memory (training memory), or none (width rates = levels); "
        "default params (the fedhm_ prefix of levels.match is also accepted)",
    )
    parser.add_argument(
        "--ablations",
        default=" ".join(COMPARE_ABLATIONS),
        help="space-separated FedHM options, one extra sweep each ('' for none)",
    )
    parser.add_argument(
        "--continue",
        dest="cont",
        type=Path,
        metavar="DIR",
        help="continue the interrupted comparison in DIR: its finished jobs are kept",
    )
    args = parser.parse_intermixed_args(argv)
    if args.cont is not None:
        plan_file = args.cont.resolve() / "compare.json"
        if not plan_file.is_file():
            print(
                f"error: invalid config: --continue={str(args.cont)!r}; allowed: a comparison directory holding "
                "compare.json (the folder an interrupted `fedhm compare` named)",
                file=sys.stderr,
            )
            return 2
        plan = json.loads(plan_file.read_text())
        root, sweeps, matched, seeds = plan["root"], plan["sweeps"], plan["matched"], plan["seeds"]
    else:
        root, sweeps = compare_plan(
            split_overrides(args.overrides), args.seeds, args.match, tuple(args.ablations.split())
        )
        matched = (
            f"budget-matched comparison (levels.match={args.match}: HeteroFL/FedRolex/FjORD width rates chosen "
            f"per level to match FedHM's {MATCH_WORDS[args.match]}"
            + (", FIARSE's sizes its parameter count)" if args.match == "params" else "; FIARSE matches params only)")
            if args.match != "none"
            else "unmatched comparison (levels.match=none: width rates = levels)"
        )
        seeds = args.seeds
        root = str(Path(root).resolve())
        sweeps = [
            [
                o if _key(o) != "hydra.sweep.dir" else f"hydra.sweep.dir={Path(o.split('=', 1)[1]).resolve()}"
                for o in overrides
            ]
            for overrides in sweeps
        ]
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / "compare.json").write_text(
            json.dumps({"root": root, "sweeps": sweeps, "matched": matched, "seeds": seeds}, indent=1)
        )
    print(f"fedhm compare: {matched}, seeds {seeds}, {len(sweeps)} sweep(s), outputs in {root}", flush=True)
    again = {
        CONTINUE_COMMAND_VAR: shlex.join([*fedhm_program(), "compare", "--continue", root]),
        QUIET_SUMMARY_VAR: "1",
    }
    with sweep_services([o for overrides in sweeps for o in overrides]) as shared:  # for every sweep
        code = _compare_sweeps(sweeps, args.cont is not None, {**again, **shared})
    if code != 0:
        return code
    code = summary_main([root, "--out", root, "--reference", "fedhm"])
    print(f"fedhm compare: {matched}; tables and plots in {root} (statistics.md, paired.csv)")
    return code


def _compare_sweeps(sweeps: list[list[str]], cont: bool, again: dict[str, str]) -> int:
    """Each sweep of a comparison in turn (a continued one from where it stopped); the first failure's code."""
    for overrides in sweeps:
        sweep_dir = Path(overrides[-1].split("=", 1)[1])
        if cont and (sweep_dir / "multirun.yaml").is_file():
            code = _hydra_sweep(_sweep_continuation(sweep_dir), {CONTINUE_VAR: "1", **again})
        else:
            code = _hydra_sweep(overrides, {**again, **({CONTINUE_VAR: "1"} if cont else {})})
        if code != 0:
            return code
    return 0
