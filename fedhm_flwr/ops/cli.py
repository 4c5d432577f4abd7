"""The ``fedhm`` command: one entry point for every job of the project.

Every subcommand takes the same Hydra overrides as ``make ... ARGS=...`` and the ``python -m``
modules (which stay, as aliases); ``fedhm <subcommand> --help`` shows a working example.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from fedhm_flwr.config import OPTIONS, ConfigError, split_overrides
from fedhm_flwr.ops.deploy.device_run import resume_refusal
from fedhm_flwr.ops.job.launch import run_job
from fedhm_flwr.ops.job.outcome import fedhm_commands, report_finished, report_stop
from fedhm_flwr.ops.job.procs import Interrupted, on_signals
from fedhm_flwr.ops.job.progress import run_with_progress
from fedhm_flwr.ops.job.status import main as status_main
from fedhm_flwr.ops.sweeps import multirun
from fedhm_flwr.ops.sweeps.multirun import COMPARE_OVERRIDES, compare_plan  # noqa: F401  (compare_plan: tests import it here)
from fedhm_flwr.reporting.startup import parts_line


@dataclass(frozen=True)
class Command:
    summary: str
    examples: tuple[str, ...]
    handler: Callable[[list[str]], int]
    module: str | None = None  # the ``python -m`` module it runs (delegated help)
    short: str = ""  # the line in ``fedhm --help`` (default: the summary)


# --------------------------------------------------------------------------- run, resume


def _run_job(overrides: list[str], run_dir: Path | None, resume: Path | None, progress: bool) -> int:
    commands = fedhm_commands()  # an interrupted or failed run says `fedhm resume <run dir>`
    try:
        if progress:
            summary = run_with_progress(overrides, run_dir=run_dir, resume=resume, commands=commands)
        else:
            summary = run_job(overrides, run_dir=run_dir, resume=resume, commands=commands)
    except (ConfigError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # RunFailed: its last line says why (the first ServerApp / client error)
        print(f"error: {err}", file=sys.stderr)
        return 1
    if progress and summary.get("startup_parts"):  # (without the progress line, the ServerApp's log says it)
        print(f"start-up: {parts_line(summary['startup_parts'])}", flush=True)
    return report_finished(summary)  # exit 1 when the model diverged or no reply was accepted


def _parser(name: str) -> argparse.ArgumentParser:
    cmd = COMMANDS[name]
    return argparse.ArgumentParser(
        prog=f"fedhm {name}",
        description=cmd.summary,
        epilog=_examples(cmd),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def cmd_run(argv: list[str]) -> int:
    parser = _parser("run")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method.tau=2 levels.ratios=[1,0.5]")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: outputs/<date>/<time>-<method>)")
    parser.add_argument(
        "--no-progress", action="store_true", help="Flower's own output on the console instead of the progress line"
    )
    args = parser.parse_args(argv)
    return _run_job(split_overrides(args.overrides), args.run_dir, None, not args.no_progress)


def cmd_resume(argv: list[str]) -> int:
    parser = _parser("resume")
    parser.add_argument("run_dir", type=Path, help="the run directory whose checkpoint the run continues")
    parser.add_argument("overrides", nargs="*", help="plain key=value overrides, e.g. rounds=20 to extend it")
    parser.add_argument("--no-progress", action="store_true", help="Flower's own output instead of the progress line")
    args = parser.parse_args(argv)
    if refusal := resume_refusal(args.run_dir.resolve()):  # a device run resumes on its devices, not here
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    return _run_job(split_overrides(args.overrides), None, args.run_dir.resolve(), not args.no_progress)


# ------------------------------------------------------------------ sweep, compare (fedhm_flwr/ops/sweeps/multirun.py)


def cmd_sweep(argv: list[str]) -> int:
    return multirun.cmd_sweep(argv, _parser("sweep"))


def cmd_compare(argv: list[str]) -> int:
    return multirun.cmd_compare(argv, _parser("compare"))


# --------------------------------------------------------------------------- status


def cmd_status(argv: list[str]) -> int:
    parser = _parser("status")
    parser.add_argument("run_dir", type=Path, help="the run directory (the ServerApp's output-dir)")
    parser.add_argument("--wait", action="store_true", help="wait while the run is still running, then report")
    args = parser.parse_args(argv)
    return status_main(args.run_dir, wait=args.wait)


# --------------------------------------------------------------------------- delegated commands


def _delegate(name: str) -> Callable[[list[str]], int]:
    def handler(argv: list[str]) -> int:
        cmd = COMMANDS[name]
        assert cmd.module is not None
        helping = bool({"-h", "--help"} & set(argv))
        if helping:
            print(f"usage: fedhm {name} ...\n\n{cmd.summary}\n\n{_examples(cmd)}\n")
        try:
            module = _import(cmd.module)
        except ModuleNotFoundError as err:
            if err.name not in (cmd.module, cmd.module.split(".")[0]):
                raise
            print(
                f"{'note' if helping else 'error'}: `fedhm {name}` needs {cmd.module}, which this installation "
                "does not have" + (" (run it from the repository root)" if cmd.module.startswith("bench") else ""),
                file=sys.stdout if helping else sys.stderr,
            )
            return 0 if helping else 2
        if helping and name != "export":
            print(f"Runs `python -m {cmd.module}`; its options:\n")
        try:
            return int(module.main(argv) or 0)
        except SystemExit as exit_:  # argparse's --help and usage errors
            return exit_.code if isinstance(exit_.code, int) else 2

    return handler


def _import(module: str) -> ModuleType:
    if module.startswith("bench."):  # the benchmarks live in the repository, not in the package
        root = str(Path(__file__).resolve().parents[2])
        if root not in sys.path:
            sys.path.insert(0, root)
    return importlib.import_module(module)


# --------------------------------------------------------------------------- the command


COMMANDS: dict[str, Command] = {
    "run": Command(
        "Run one job through `flwr run` on a private SuperLink (Ray simulation engine), with a "
        "progress line; Flower's output goes to <run dir>/flwr_run.log.",
        (
            "fedhm run rounds=2 model.width=8 'levels.ratios=[1,0.25]' --run-dir /tmp/fedhm/r1",
            "fedhm run method=heterofl partition.alpha=0.1 rounds=3",
        ),
        cmd_run,
        short="one job through `flwr run` (Ray simulation), with a progress line",
    ),
    "resume": Command(
        "Continue a run from its checkpoint; plain key=value overrides such as rounds=20 extend it.",
        ("fedhm resume /tmp/fedhm/r1 rounds=4",),
        cmd_resume,
        short="continue a run from its checkpoint (rounds=N extends it)",
    ),
    "sweep": Command(
        "Hydra multirun: every combination is one job (one progress line each); the sweep "
        "directory gets summary.md/.csv and plots.",
        (
            "fedhm sweep 'levels.ratios=[1,0.5,0.25,0.125],[1,0.25]' method.tau=1,inf rounds=3",
            "fedhm sweep seed=0,1,2 rounds=3 hydra/launcher=joblib hydra.launcher.n_jobs=2",
        ),
        cmd_sweep,
        short="a Hydra multirun of jobs; summary table and plots in the sweep directory",
    ),
    "compare": Command(
        "FedHM vs HeteroFL and FedRolex (budget-matched), FedAvg-full and FedAvg-smallest on every "
        "seed, then FedHM with each ablation (self-distillation, the official code's two switches) "
        f"on the same seeds ({' '.join(COMPARE_OVERRIDES)} unless you override them); statistics "
        "over seeds and paired differences against FedHM in outputs/compare/<time>/statistics.md.",
        (
            "fedhm compare rounds=3 dataset.max_train_examples=5000 --seeds 0 --ablations ''",
            "fedhm compare method=fedhm,heterofl --match none",
        ),
        cmd_compare,
        short="FedHM vs HeteroFL, FedRolex (matched), FedAvg-full/smallest + ablations over seeds",
    ),
    "status": Command(
        "A run's final status from its directory (also a deployed run started with `flwr run`): "
        "exit 0 completed, 1 failed or stopped (with why and the last checkpoint), 3 still running, "
        "2 not a run directory.",
        ("fedhm status /tmp/fedhm/r1", "fedhm status /srv/runs/r7 --wait"),
        cmd_status,
        short="a run's final status (exit 0 completed, 1 failed or stopped, 3 running)",
    ),
    "deploy-local": Command(
        "A real Flower deployment on this machine: a SuperLink with TLS and SuperNode "
        "authentication, N SuperNodes with declared capabilities, the job through `flwr run`, "
        "everything stopped at the end (docs/DEPLOY.md); `--credentials-only DIR` writes a "
        "deployment's credentials for real machines.",
        (
            "fedhm deploy-local --nodes 3 --capabilities 'params=2e4 memory=6.5M -' rounds=2 model.width=8",
            "fedhm deploy-local --nodes 4 --credentials-only creds --san fl.example.org",
        ),
        _delegate("deploy-local"),
        "fedhm_flwr.ops.deploy.deploy_local",
        "SuperLink (TLS, node auth) + N SuperNodes on loopback, runs the job",
    ),
    "stage": Command(
        "Copy the app alone (its packages, conf/, pyproject.toml; not tests/, docs/, results/, "
        "outputs) to DEST and print DEST: what `flwr run DEST <connection>` sends to the SuperLink and "
        "every device, as `fedhm deploy-local` does (docs/DEPLOY.md).",
        ("fedhm stage /srv/fedhm/app", 'flwr run "$(fedhm stage /tmp/fedhm-app)" fedhm --stream'),
        _delegate("stage"),
        "fedhm_flwr.ops.deploy.stage",
        "the app alone, staged for `flwr run` on real devices (not tests/ docs/ results/)",
    ),
    "inspect": Command(
        "Per-level parameters, MACs and payload bytes of a configuration, and FedHM's per-layer plan, "
        "without training.",
        (
            "fedhm inspect model=resnet18 dataset=cifar10",
            "fedhm inspect levels.ratios=[1,0.5,0.25] --json",
            "fedhm inspect model.target=torchvision.models:resnet18 model.kwargs.num_classes=10 dataset=cifar10",
        ),
        _delegate("inspect"),
        "fedhm_flwr.ops.tools.cost_table",
        "per-level parameters, MACs, payload bytes (no training)",
    ),
    "summary": Command(
        "One table and two plots over finished runs or sweep folders.",
        ("fedhm summary outputs/multirun outputs/compare --out outputs/all-runs",),
        _delegate("summary"),
        "fedhm_flwr.reporting.summary",
        "one table and plots over finished runs",
    ),
    "shards": Command(
        "A node's own data shard (export / load), for real devices; runs fedhm_flwr.ops.deploy.shard_export "
        "(imported when called: available once that module is installed).",
        ("fedhm shards --help",),
        _delegate("shards"),
        "fedhm_flwr.ops.deploy.shard_export",
        "a node's own data shard for real devices (fedhm_flwr.ops.deploy.shard_export, when installed)",
    ),
    "supernode": Command(
        "flower-supernode with the same arguments, kept running: started again after it dies "
        "(with a back-off; after a refused activation once the heartbeat window is out), and "
        "what it started (its ClientApps) ended with it; for devices (docs/DEPLOY.md).",
        (
            "fedhm supernode --superlink fl.example.org:8000 --root-certificates ca.pem "
            "--auth-supernode-private-key node.key --node-config node-config.toml",
        ),
        _delegate("supernode"),
        "fedhm_flwr.ops.deploy.supernode",
        "flower-supernode kept running, its ClientApps ended with it (a device's SuperNode)",
    ),
    "superlink": Command(
        "flower-superlink with the same arguments, that says so and exits 1 when its helper flower-superexec "
        "(which starts every ServerApp) has died or never started, instead of staying up without it; for the "
        "server (docs/DEPLOY.md).",
        (
            "fedhm superlink --ssl-ca-certfile ca.pem --ssl-certfile server.pem --ssl-keyfile server.key "
            "--enable-supernode-auth --database state.db",
        ),
        _delegate("superlink"),
        "fedhm_flwr.ops.deploy.link_guard",
        "flower-superlink that exits 1 when its flower-superexec died (the server's SuperLink)",
    ),
    "export": Command(
        "A level's deployable model from a run's checkpoint: safetensors (spec in the metadata), "
        "torch.export .pt2, ONNX where an exporter is installed, and a model card.",
        ("fedhm export run=/tmp/fedhm/r1 level=1/4", "fedhm export run=/tmp/fedhm/r1 level=1 out=/tmp/fedhm/r1-full"),
        _delegate("export"),
        "fedhm_flwr.ops.tools.export",
        "a level's deployable model: safetensors, .pt2, model card",
    ),
    "bench": Command(
        "The benchmarks: server time, bytes, step time per level, Flower overhead, scale "
        "(bench/reports/bench.{json,md}).",
        ("fedhm bench --quick --only 2",),
        _delegate("bench"),
        "bench.run",
        "the benchmarks (bench/reports/bench.{json,md})",
    ),
}


def _examples(cmd: Command) -> str:
    return "examples:\n" + "\n".join(f"  {e}" for e in cmd.examples)


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: fedhm <command> [HYDRA OVERRIDES | OPTIONS ...]",
        "",
        "FedHM and its sibling methods on Flower's Message API. Commands:",
        "",
    ]
    for name, cmd in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {cmd.short or cmd.summary}")
        lines.append(f"  {'':<{width}}    e.g. {cmd.examples[0]}")
    lines += [
        "",
        f"Methods (method=<name>, docs/METHODS.md): {', '.join(OPTIONS)}",
        "",
        "`fedhm <command> --help` for a command's options and examples. The same overrides work with",
        "`make run ARGS=...` and `python -m fedhm_flwr.ops.job.launch ...`; Python: fedhm_flwr.api.run([...]).",
    ]
    return "\n".join(lines)


def signal_name(stop: BaseException) -> str:
    signum = getattr(stop, "signum", signal.SIGINT)
    return signal.Signals(signum).name


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; allowed: {list(COMMANDS)}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    try:
        with on_signals():  # SIGINT / SIGTERM / SIGHUP: the run stops cleanly, no traceback, exit 128 + signal
            return COMMANDS[name].handler(rest)
    except SystemExit as exit_:  # argparse: --help (0) and usage errors (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt as stop:  # RunInterrupted (everything stopped; the resume command) or before a start
        if name not in ("run", "resume", "deploy-local"):  # bench: its runs live in temporary folders
            code = stop.exit_code if isinstance(stop, Interrupted) else 130
            what = signal_name(stop)
            print(
                f"\n{what} received: `fedhm {name}` stopped; every process it started has been stopped.",
                file=sys.stderr,
                flush=True,
            )
            return code
        return report_stop(stop)


if __name__ == "__main__":
    sys.exit(main())
