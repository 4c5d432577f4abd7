"""The ``fedhm`` command: one entry point for every job of the project.

Every subcommand takes the same Hydra overrides as ``make ... ARGS=...`` and the ``python -m``
modules (which stay, as aliases); ``fedhm <subcommand> --help`` shows a working example.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedhm_flwr.config import ConfigError, split_overrides

#: `fedhm compare` (`make compare`): the baselines on the same work, every method on every seed,
#: then one FedHM sweep per ablation; about 5 min per run on 2 cores (24 runs with 3 seeds)
COMPARE_METHODS = "fedhm,heterofl,fedrolex,fedavg,fedavg_smallest"
COMPARE_OVERRIDES = ("rounds=8", "dataset.max_train_examples=30000")
COMPARE_SEEDS = "0,1,2"
COMPARE_MATCH = "fedhm_params"
COMPARE_ABLATIONS = ("train.distill.enabled=true", "method.official_weights=true", "method.add_previous_global=true")


@dataclass(frozen=True)
class Command:
    summary: str
    examples: tuple[str, ...]
    handler: Callable[[list[str]], int]
    module: str | None = None  # the ``python -m`` module it runs (delegated help)
    short: str = ""  # the line in ``fedhm --help`` (default: the summary)


# --------------------------------------------------------------------------- run, resume


def _print_result(summary: dict) -> None:
    acc = summary.get("final_acc/global")
    print(f"run complete: final global accuracy {acc if acc is None else f'{acc:.4f}'}; "
          f"outputs in {summary['output_dir']}")


def _run_job(overrides: list[str], run_dir: Path | None, resume: Path | None, progress: bool) -> int:
    from fedhm_flwr.launch import fedhm_commands, run_job
    from fedhm_flwr.progress import run_with_progress

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
    _print_result(summary)
    return 0


def _parser(name: str) -> argparse.ArgumentParser:
    cmd = COMMANDS[name]
    return argparse.ArgumentParser(prog=f"fedhm {name}", description=cmd.summary, epilog=_examples(cmd),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def cmd_run(argv: list[str]) -> int:
    parser = _parser("run")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method.tau=2 levels.ratios=[1,0.5]")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: outputs/<date>/<time>-<method>)")
    parser.add_argument("--no-progress", action="store_true",
                        help="Flower's own output on the console instead of the progress line")
    args = parser.parse_args(argv)
    return _run_job(split_overrides(args.overrides), args.run_dir, None, not args.no_progress)


def cmd_resume(argv: list[str]) -> int:
    parser = _parser("resume")
    parser.add_argument("run_dir", type=Path, help="the run directory whose checkpoint the run continues")
    parser.add_argument("overrides", nargs="*", help="plain key=value overrides, e.g. rounds=20 to extend it")
    parser.add_argument("--no-progress", action="store_true", help="Flower's own output instead of the progress line")
    args = parser.parse_args(argv)
    return _run_job(split_overrides(args.overrides), None, args.run_dir.resolve(), not args.no_progress)


# --------------------------------------------------------------------------- sweep, compare


#: set for a sweep that continues an interrupted one: its finished jobs are kept, an interrupted job
#: is resumed from its checkpoint (fedhm_flwr/sweep.py)
CONTINUE_VAR = "FEDHM_SWEEP_CONTINUE"
#: what an interrupted sweep prints as the command that continues it (compare: ``fedhm compare --continue``)
CONTINUE_COMMAND_VAR = "FEDHM_CONTINUE_COMMAND"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the sweep process gets SIGTERM when `fedhm` dies, even by SIGKILL (then it stops its job)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


def _hydra_sweep(overrides: list[str], env: dict[str, str] | None = None) -> int:
    """``python -m fedhm_flwr.sweep -m OVERRIDES``, as its own process: Hydra finds its config tree
    relative to the entry point's file and owns the process while the multirun lasts.

    The sweep runs in a process group of its own and this process forwards SIGINT / SIGTERM /
    SIGHUP to it, once (a terminal's Ctrl-C reaches only this foreground group); the sweep stops
    its job, says which jobs finished and how to continue, and exits 128 + the signal, which is
    this command's exit code."""
    import os
    import signal
    import subprocess

    from fedhm_flwr.procs import SIGNALS

    cmd = [sys.executable, "-m", "fedhm_flwr.sweep", "-m", *[o for o in overrides if o not in ("-m", "--multirun")]]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, process_group=0,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    sent: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not sent:
            sent.append(signum)
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass
        else:
            print(f"{signal.Signals(signum).name} received: the sweep is still stopping its job, please wait",
                  file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, forward) for sig in SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    if code < 0:  # killed by a signal it did not handle
        code = 128 - code
    return code


def _sweep_continuation(sweep_dir: Path) -> list[str]:
    """The overrides that run the sweep stored in ``sweep_dir`` again, into the same directory:
    its task overrides and its Hydra overrides (launcher, ...) from Hydra's ``multirun.yaml``."""
    from omegaconf import OmegaConf

    saved = sweep_dir / "multirun.yaml"
    if not saved.is_file():
        raise ConfigError("--continue", str(sweep_dir), "a sweep directory holding Hydra's multirun.yaml "
                          "(the folder an interrupted sweep named)")
    cfg = OmegaConf.load(saved)
    hydra_overrides = [o for o in cfg.hydra.overrides.hydra
                       if _key(o) not in ("hydra.mode", "hydra.sweep.dir")]
    return [*cfg.hydra.overrides.task, *hydra_overrides, f"hydra.sweep.dir={sweep_dir}"]


def _sweep_help(name: str) -> int:
    parser = _parser(name)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides; comma-separated values are swept "
                        "(`-m` is implied), hydra/launcher=... picks a Hydra launcher")
    parser.print_help()
    return 0


def cmd_sweep(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        return _sweep_help("sweep")
    if argv and argv[0] == "--continue":
        if len(argv) != 2:
            print("error: usage: fedhm sweep --continue <sweep dir>", file=sys.stderr)
            return 2
        try:
            overrides = _sweep_continuation(Path(argv[1]).resolve())
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return _hydra_sweep(overrides, {CONTINUE_VAR: "1"})
    return _hydra_sweep(argv)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compare_plan(user: list[str], seeds: str = COMPARE_SEEDS, match: str = COMPARE_MATCH,
                 ablations: tuple[str, ...] = COMPARE_ABLATIONS,
                 now: dt.datetime | None = None) -> tuple[str, list[list[str]]]:
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


def cmd_compare(argv: list[str]) -> int:
    import json
    import shlex

    parser = _parser("compare")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every run (rounds=3, method=fedhm,heterofl ...)")
    parser.add_argument("--seeds", default=COMPARE_SEEDS, help=f"comma-separated seeds (default {COMPARE_SEEDS})")
    parser.add_argument("--match", default=COMPARE_MATCH, choices=["fedhm_params", "none"],
                        help="levels.match of the width methods (default fedhm_params: budget-matched)")
    parser.add_argument("--ablations", default=" ".join(COMPARE_ABLATIONS),
                        help="space-separated FedHM options, one extra sweep each ('' for none)")
    parser.add_argument("--continue", dest="cont", type=Path, metavar="DIR",
                        help="continue the interrupted comparison in DIR: its finished jobs are kept")
    args = parser.parse_intermixed_args(argv)
    if args.cont is not None:
        plan_file = args.cont.resolve() / "compare.json"
        if not plan_file.is_file():
            print(f"error: invalid config: --continue={str(args.cont)!r}; allowed: a comparison directory holding "
                  "compare.json (the folder an interrupted `fedhm compare` named)", file=sys.stderr)
            return 2
        plan = json.loads(plan_file.read_text())
        root, sweeps, matched, seeds = plan["root"], plan["sweeps"], plan["matched"], plan["seeds"]
    else:
        root, sweeps = compare_plan(split_overrides(args.overrides), args.seeds, args.match,
                                    tuple(args.ablations.split()))
        matched = ("budget-matched comparison (levels.match=fedhm_params: HeteroFL/FedRolex width rates chosen per "
                   "level to match FedHM's parameter count)" if args.match == "fedhm_params"
                   else "unmatched comparison (levels.match=none: width rates = levels)")
        seeds = args.seeds
        root = str(Path(root).resolve())
        sweeps = [[o if _key(o) != "hydra.sweep.dir" else f"hydra.sweep.dir={Path(o.split('=', 1)[1]).resolve()}"
                   for o in overrides] for overrides in sweeps]
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / "compare.json").write_text(json.dumps({"root": root, "sweeps": sweeps, "matched": matched,
                                                             "seeds": seeds}, indent=1))
    print(f"fedhm compare: {matched}, seeds {seeds}, {len(sweeps)} sweep(s), outputs in {root}", flush=True)
    from fedhm_flwr.launch import fedhm_program

    again = {CONTINUE_COMMAND_VAR: shlex.join([*fedhm_program(), "compare", "--continue", root])}
    for overrides in sweeps:
        sweep_dir = Path(overrides[-1].split("=", 1)[1])
        if args.cont is not None and (sweep_dir / "multirun.yaml").is_file():
            code = _hydra_sweep(_sweep_continuation(sweep_dir), {CONTINUE_VAR: "1", **again})
        else:
            code = _hydra_sweep(overrides, {**again, **({CONTINUE_VAR: "1"} if args.cont is not None else {})})
        if code != 0:
            return code
    from fedhm_flwr.summary import main as summary_main

    code = summary_main([root, "--out", root, "--reference", "fedhm"])
    print(f"fedhm compare: {matched}; tables and plots in {root} (statistics.md, paired.csv)")
    return code


# --------------------------------------------------------------------------- status


def cmd_status(argv: list[str]) -> int:
    parser = _parser("status")
    parser.add_argument("run_dir", type=Path, help="the run directory (the ServerApp's output-dir)")
    parser.add_argument("--wait", action="store_true", help="wait while the run is still running, then report")
    args = parser.parse_args(argv)
    from fedhm_flwr.status import main as status_main

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
            print(f"{'note' if helping else 'error'}: `fedhm {name}` needs {cmd.module}, which this installation "
                  "does not have" + (" (run it from the repository root)" if cmd.module.startswith("bench") else ""),
                  file=sys.stdout if helping else sys.stderr)
            return 0 if helping else 2
        if helping and name != "export":
            print(f"Runs `python -m {cmd.module}`; its options:\n")
        try:
            return int(module.main(argv) or 0)
        except SystemExit as exit_:  # argparse's --help and usage errors
            return exit_.code if isinstance(exit_.code, int) else 2

    return handler


def _import(module: str):
    if module.startswith("bench."):  # the benchmarks live in the repository, not in the package
        root = str(Path(__file__).resolve().parent.parent)
        if root not in sys.path:
            sys.path.insert(0, root)
    return importlib.import_module(module)


# --------------------------------------------------------------------------- the command


COMMANDS: dict[str, Command] = {
    "run": Command("Run one job through `flwr run` on a private SuperLink (Ray simulation engine), with a "
                   "progress line; Flower's output goes to <run dir>/flwr_run.log.",
                   ("fedhm run rounds=2 model.width=8 'levels.ratios=[1,0.25]' --run-dir /tmp/fedhm/r1",
                    "fedhm run method=heterofl partition.alpha=0.1 rounds=3"), cmd_run,
                   short="one job through `flwr run` (Ray simulation), with a progress line"),
    "resume": Command("Continue a run from its checkpoint; plain key=value overrides such as rounds=20 extend it.",
                      ("fedhm resume /tmp/fedhm/r1 rounds=4",), cmd_resume,
                      short="continue a run from its checkpoint (rounds=N extends it)"),
    "sweep": Command("Hydra multirun: every combination is one job (one progress line each); the sweep "
                     "directory gets summary.md/.csv and plots.",
                     ("fedhm sweep 'levels.ratios=[1,0.5,0.25,0.125],[1,0.25]' method.tau=1,inf rounds=3",
                      "fedhm sweep seed=0,1,2 rounds=3 hydra/launcher=joblib hydra.launcher.n_jobs=2"), cmd_sweep,
                     short="a Hydra multirun of jobs; summary table and plots in the sweep directory"),
    "compare": Command("FedHM vs HeteroFL and FedRolex (budget-matched), FedAvg-full and FedAvg-smallest on every "
                       "seed, then FedHM with each ablation (self-distillation, the official code's two switches) "
                       f"on the same seeds ({' '.join(COMPARE_OVERRIDES)} unless you override them); statistics "
                       "over seeds and paired differences against FedHM in outputs/compare/<time>/statistics.md.",
                       ("fedhm compare rounds=3 dataset.max_train_examples=5000 --seeds 0 --ablations ''",
                        "fedhm compare method=fedhm,heterofl --match none"), cmd_compare,
                       short="FedHM vs HeteroFL, FedRolex (matched), FedAvg-full/smallest + ablations over seeds"),
    "status": Command("A run's final status from its directory (also a deployed run started with `flwr run`): "
                      "exit 0 completed, 1 failed or stopped (with why and the last checkpoint), 3 still running, "
                      "2 not a run directory.",
                      ("fedhm status /tmp/fedhm/r1", "fedhm status /srv/runs/r7 --wait"), cmd_status,
                      short="a run's final status (exit 0 completed, 1 failed or stopped, 3 running)"),
    "inspect": Command("Per-level parameters, MACs and payload bytes of a configuration, and FedHM's per-layer plan, without training.",
                       ("fedhm inspect model=resnet18 dataset=cifar10", "fedhm inspect levels.ratios=[1,0.5,0.25] --json",
                        "fedhm inspect model.target=torchvision.models:resnet18 model.kwargs.num_classes=10 dataset=cifar10"),
                       _delegate("inspect"), "fedhm_flwr.inspect", "per-level parameters, MACs, payload bytes (no training)"),
    "summary": Command("One table and two plots over finished runs or sweep folders.",
                       ("fedhm summary outputs/multirun outputs/compare --out outputs/all-runs",),
                       _delegate("summary"), "fedhm_flwr.summary", "one table and plots over finished runs"),
    "shards": Command("A node's own data shard (export / load), for real devices; runs fedhm_flwr.shards "
                      "(imported when called: available once that module is installed).",
                      ("fedhm shards --help",), _delegate("shards"), "fedhm_flwr.shards",
                      "a node's own data shard for real devices (fedhm_flwr.shards, when installed)"),
    "supernode": Command("flower-supernode with the same arguments, started again once when the SuperLink still "
                         "holds the session of a killed predecessor (it waits out the heartbeat window itself); "
                         "for devices (docs/DEPLOY.md).",
                         ("fedhm supernode --superlink fl.example.org:8000 --root-certificates ca.pem "
                          "--auth-supernode-private-key node.key --node-config node-config.toml",),
                         _delegate("supernode"), "fedhm_flwr.supernode",
                         "flower-supernode that comes back after a kill (a device's SuperNode)"),
    "export": Command("A level's deployable model from a run's checkpoint: safetensors (spec in the metadata), "
                      "torch.export .pt2, ONNX where an exporter is installed, and a model card.",
                      ("fedhm export run=/tmp/fedhm/r1 level=1/4",
                       "fedhm export run=/tmp/fedhm/r1 level=1 out=/tmp/fedhm/r1-full"),
                      _delegate("export"), "fedhm_flwr.export", "a level's deployable model: safetensors, .pt2, model card"),
    "bench": Command("The benchmarks: server time, bytes, step time per level, Flower overhead, scale "
                     "(bench/reports/bench.{json,md}).",
                     ("fedhm bench --quick --only 2",), _delegate("bench"), "bench.run",
                     "the benchmarks (bench/reports/bench.{json,md})"),
}


def _examples(cmd: Command) -> str:
    return "examples:\n" + "\n".join(f"  {e}" for e in cmd.examples)


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: fedhm <command> [HYDRA OVERRIDES | OPTIONS ...]", "",
             "FedHM and its sibling methods on Flower's Message API. Commands:", ""]
    for name, cmd in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {cmd.short or cmd.summary}")
        lines.append(f"  {'':<{width}}    e.g. {cmd.examples[0]}")
    lines += ["", "`fedhm <command> --help` for a command's options and examples. The same overrides work with",
              "`make run ARGS=...` and `python -m fedhm_flwr.launch ...`; Python: fedhm_flwr.api.run([...])."]
    return "\n".join(lines)


def signal_name(stop: BaseException) -> str:
    import signal

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
    from fedhm_flwr.launch import report_stop
    from fedhm_flwr.procs import on_signals

    try:
        with on_signals():  # SIGINT / SIGTERM / SIGHUP: the run stops cleanly, no traceback, exit 128 + signal
            return COMMANDS[name].handler(rest)
    except SystemExit as exit_:  # argparse: --help (0) and usage errors (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt as stop:  # RunInterrupted (everything stopped; the resume command) or before a start
        if name not in ("run", "resume"):  # bench: its runs live in temporary folders, nothing to resume
            from fedhm_flwr.procs import Interrupted

            code = stop.exit_code if isinstance(stop, Interrupted) else 130
            what = signal_name(stop)
            print(f"\n{what} received: `fedhm {name}` stopped; every process it started has been stopped.",
                  file=sys.stderr, flush=True)
            return code
        return report_stop(stop)


if __name__ == "__main__":
    sys.exit(main())
