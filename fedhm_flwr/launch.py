"""Run one job through ``flwr run`` on Flower's Ray-backed simulation engine, safely.

``python -m fedhm_flwr.launch [HYDRA OVERRIDES ...]`` (what ``make run`` calls):

1. composes and validates the Hydra config and checks the run's data (a bad value or missing
   data stops here, exit 2, before anything starts);
2. locks the run directory (``<run dir>/.lock``): a second launch into a directory that a live
   run is using is refused (exit 2), naming the directory and the live PID;
3. starts a watchdog (``fedhm_flwr.procs``) and a private SuperLink in simulation mode on a free
   loopback port, with its own ``FLWR_HOME`` inside the run directory and runtime dependency
   installation disabled; every process started carries the job's tag;
4. stages the app's own files (packages, Hydra tree, metadata) next to the run and runs
   ``flwr run <staged app> <connection> --stream`` with the overrides and the absolute run
   directory as run-config, and ``num-supernodes`` / client resources from the config;
5. reads its own run id from ``flwr run``'s output and judges the run by that id's final status
   (``flwr list --run-id <id> --format json``; ``--stream`` exits 0 even when a run failed) and
   by a summary written by this run;
6. stops every process it started (SuperLink, SuperExec, ``flwr-simulation``, Ray), also on
   failure. On Ctrl-C / SIGTERM / SIGHUP it first stops the Flower run (``flwr stop <id>``),
   keeps the last complete checkpoint, prints the command that resumes the run and exits
   128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). If the launcher is killed
   outright, the watchdog stops everything within seconds.

``scripts/deploy_local.py`` runs its job through the same runner (:func:`run_flower_job`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fedhm_flwr.data_files import check_data_available
from fedhm_flwr.config import ConfigError, compose_config, load_config, resume_config, split_overrides
from fedhm_flwr.procs import Interrupted, Processes, RunLock, kill_serverapp, killpg_quietly, new_tag, on_signals
from fedhm_flwr.results import CHECKPOINT_DIR, STATE_FILE, SUMMARY_FILE, load_checkpoint, refuse_existing_run

APP_DIR = Path(__file__).resolve().parent.parent


#: what the Flower app bundle needs: the project's packages, its Hydra tree and its metadata
APP_CONTENT = ("pyproject.toml", "README.md", "fedhm_flwr", "strategies", "clients", "conf")


def stage_app(dest: Path) -> Path:
    """Copy the app's own files to ``dest`` and return it.

    ``flwr run <dir>`` walks the whole folder to build the app bundle: in a checkout that is also
    the virtualenv (GBs) and every earlier output, seconds of work per run. A staged copy holds
    only what the bundle needs (and is exactly what ran, kept with the run's outputs)."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in APP_CONTENT:
        src = APP_DIR / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    """An executable of this Python environment (works without an activated venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def default_run_dir(method: str) -> Path:
    root = Path(os.environ.get("FEDHM_OUTPUT_ROOT", APP_DIR / "outputs")).expanduser()
    now = dt.datetime.now()
    return (root / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S-%f')}-{method}").resolve()


CONNECTION = "job"  # name of the private SuperLink in the launcher's FLWR_HOME/config.toml


def superlink_env(flwr_home: Path, port: int, ray_address: str | None = None) -> dict[str, str]:
    """Environment of the private SuperLink and of the ``flwr`` CLI talking to it.

    ``RAY_ADDRESS`` reaches ``ray.init`` in ``flwr-simulation`` (Flower's Ray backend calls it with
    its ``init_args``, and the federation config carries no address): ``ray_address``
    (``simulation.ray_address``: ``auto`` or ``HOST:PORT``) runs the clients on that cluster;
    without one, ``local``, a private Ray instance even where a cluster runs on this machine
    (plain ``ray.init()`` would join the last one started here)."""
    env = dict(os.environ)
    env.update({
        "RAY_ADDRESS": ray_address or "local",
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        # Flower starts its helpers (flower-superexec, flwr-serverapp, ...) by name
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    })
    return env


def start_superlink(procs: Processes, flwr_home: Path, log_file: Path, timeout: float = 60,
                    ray_address: str | None = None) -> dict[str, str]:
    """A private simulation SuperLink on a free loopback port; returns the CLI's environment.
    Its simulations run their clients on the Ray cluster at ``ray_address`` (see :func:`superlink_env`)."""
    port = free_port()
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    cmd = [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
           "--host", "127.0.0.1", "--port", str(port), "--database", str(flwr_home / "state.db"),
           "--disable-runtime-dependency-installation"]
    env = superlink_env(flwr_home, port, ray_address)
    proc = procs.start("superlink", cmd, env, log_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}; see {log_file}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return env
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"flower-superlink did not become ready in {timeout:.0f} s; see {log_file}")


def toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def write_run_config(path: Path, overrides: Sequence[str], run_dir: Path, resume: Path | None = None) -> Path:
    """The run-config file of ``flwr run --run-config`` (keys of ``[tool.flwr.app.config]``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"overrides = {toml_string(' '.join(shlex.quote(o) for o in overrides))}\n"
        f"output-dir = {toml_string(str(run_dir))}\n"
        f"resume = {toml_string(str(resume) if resume else '')}\n"
    )
    return path


STARTED_RUN = re.compile(r"Successfully started run (\d+)")


class FlowerJob:
    """One ``flwr run`` of the app on a SuperLink connection, judged by its own run id.

    ``env`` is the CLI's environment (``FLWR_HOME`` holding a ``config.toml`` that names
    ``connection``); every CLI process is started through ``procs`` (tagged, own session)."""

    def __init__(self, procs: Processes, env: dict[str, str], connection: str, log_file: Path,
                 echo: bool = True) -> None:
        self.procs, self.env, self.connection, self.log_file, self.echo = procs, env, connection, log_file, echo
        self.run_id: int | None = None

    def cli(self, *args: str, timeout: float = 60) -> dict[str, Any]:
        """A ``flwr`` command with ``--format json`` on this connection; its JSON answer ({} if none)."""
        try:
            out = self.procs.run([_bin("flwr"), *args, self.connection, "--format", "json"], self.env,
                                 timeout=timeout, cwd=APP_DIR).stdout
            return dict(json.loads(out[out.index("{"):]))
        except (ValueError, subprocess.SubprocessError, OSError):
            return {}

    def run(self, app: Path, run_config: Path, extra: Sequence[str] = (), timeout: float | None = None) -> int:
        """``flwr run <app> <connection> --stream``: copy its output to the log (and the console),
        note the run id; returns its exit code. Raises :class:`TimeoutError` after ``timeout`` s."""
        cmd = [_bin("flwr"), "run", str(app), self.connection, "--stream", "--run-config", str(run_config), *extra]
        proc = self.procs.start("flwr-run", cmd, self.env, None, cwd=APP_DIR)
        timer = threading.Timer(timeout, killpg_quietly, (proc.pid, signal.SIGKILL)) if timeout else None
        if timer is not None:
            timer.start()
        try:
            assert proc.stdout is not None
            with self.log_file.open("ab") as log:
                for raw in proc.stdout:
                    log.write(raw)
                    log.flush()
                    if self.echo:
                        sys.stdout.write(raw.decode(errors="replace"))
                        sys.stdout.flush()
                    if self.run_id is None and (match := STARTED_RUN.search(raw.decode(errors="replace"))):
                        self.run_id = int(match.group(1))
            code = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
        if timer is not None and code == -signal.SIGKILL:
            raise TimeoutError(f"flwr run did not finish in {timeout:g} s")
        return code

    def status(self, wait: float = 10.0) -> str | None:
        """The final status of this job's run (``finished:completed``, ...), None if unknown.

        Waits up to ``wait`` s while the SuperLink still reports it as not finished."""
        if self.run_id is None:
            return None
        deadline = time.monotonic() + wait
        while True:
            runs = self.cli("list", "--run-id", str(self.run_id)).get("runs", [])
            status = str(runs[0].get("status")) if runs else None
            if (status or "").startswith("finished") or time.monotonic() > deadline:
                return status
            time.sleep(1.0)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the run: kill the ServerApp at once (it keeps its last checkpoint and records
        nothing more), then ``flwr stop <run id>``, best effort within ``timeout`` s, so the
        SuperLink marks the run stopped. True if the SuperLink confirmed."""
        kill_serverapp(self.procs.tag)
        if self.run_id is None:
            return False
        return bool(self.cli("stop", str(self.run_id), timeout=timeout).get("success"))


def run_flower_job(job: FlowerJob, app: Path, run_config: Path, run_dir: Path, extra: Sequence[str] = (),
                   timeout: float | None = None, see: str = "") -> dict[str, Any]:
    """Run ``job`` to its end and return the summary the run wrote.

    Raises RuntimeError unless ``flwr run`` exited 0, this run's own status is
    ``finished:completed`` and ``summary.json`` was written by this run. On a timeout or an
    interrupt (Ctrl-C, :class:`Interrupted`) the Flower run is stopped first (``flwr stop``)."""
    started = time.time()
    try:
        code = job.run(app, run_config, extra, timeout)
    except TimeoutError as err:
        job.stop()
        raise RuntimeError(f"{err}; see {job.log_file}{see}") from None
    except KeyboardInterrupt:
        job.stop()
        raise
    status = job.status()
    summary_file = run_dir / SUMMARY_FILE
    fresh = summary_file.is_file() and summary_file.stat().st_mtime >= started - 1
    if code != 0 or status != "finished:completed" or not fresh:
        raise RuntimeError(f"the run did not complete (flwr run exit {code}, run {job.run_id}, status {status!r}, "
                           f"summary {'written' if fresh else 'not written'} by this run); see {job.log_file}{see}")
    return dict(json.loads(summary_file.read_text()))


def check_data(cfg: DictConfig, simulation: bool = True) -> None:
    """The run's data is there (raises ConfigError naming the setting and the fix): the server's
    test set and, in simulation, the clients' source; a deployment's nodes check their own shard."""
    check_data_available(cfg, simulation=simulation)


def warn_level_sizes(cfg: DictConfig) -> None:
    """Before round 1, on the console: FedHM levels that do not shrink the model (stderr)."""
    if cfg.method.name != "fedhm":
        return
    from fedhm_flwr.inspect import size_warnings  # torch: only for FedHM (the config check stays torch-free)

    for line in size_warnings(cfg):
        print(f"warning: {line}", file=sys.stderr, flush=True)


def resume_hint(run_dir: Path, command: Sequence[str], overrides: Sequence[str]) -> str:
    """What to type to continue an interrupted run (``command --resume <run dir>``) or, without
    a checkpoint, to start it again (``command <overrides> [--run-dir <run dir>]``)."""
    try:
        _, saved = load_checkpoint(run_dir)
    except (FileNotFoundError, ValueError):
        try:
            refuse_existing_run(run_dir)
            again = [*command, *overrides, "--run-dir", str(run_dir)]
        except FileExistsError:  # rows but no checkpoint yet (checkpoint.every > rounds done): a new directory
            again = [*command, *overrides]
        return ("no checkpoint was written yet, so there is nothing to resume; start the run again with:\n"
                f"  cd {shlex.quote(str(APP_DIR))} && {shlex.join(again)}")
    return (f"the last complete checkpoint (round {saved.get('round')}) is in {run_dir / CHECKPOINT_DIR}; "
            f"resume the run with:\n  cd {shlex.quote(str(APP_DIR))} && {shlex.join([*command, '--resume', str(run_dir)])}")


def report_interrupt(stop: Interrupted, run_dir: Path, command: Sequence[str], overrides: Sequence[str]) -> None:
    """After the cleanup: what happened, and the command that resumes the run (stderr)."""
    print(f"\n{stop.args[0]} received: stopped the Flower run and every process it started.\n"
          f"{resume_hint(run_dir, command, overrides)}", file=sys.stderr, flush=True)


LAUNCH = (sys.executable, "-m", "fedhm_flwr.launch")


def require_checkpoint(run_dir: Path) -> None:
    if not (run_dir / CHECKPOINT_DIR / STATE_FILE).is_file():
        raise ConfigError("resume", str(run_dir), f"a run directory with a checkpoint ({CHECKPOINT_DIR}/{STATE_FILE}); "
                          "this run stopped before its first one: start it again")


def run_job(overrides: list[str], run_dir: Path | None = None, resume: Path | None = None,
            quiet: bool = False) -> dict[str, Any]:
    """Validate, run through ``flwr run``, verify; returns the run's summary.

    Raises ConfigError / FileExistsError (incl. RunDirectoryBusy) before anything starts,
    RuntimeError when the run fails and :class:`Interrupted` (after the cleanup and the printed
    resume command) on SIGINT / SIGTERM / SIGHUP."""
    # refuse missing data and bad values before anything starts (the data check first: it needs no torch)
    if resume is None:
        check_data(compose_config(overrides))
    cfg = resume_config(resume, overrides) if resume is not None else load_config(overrides)
    check_data(cfg)
    warn_level_sizes(cfg)
    if resume is not None:
        run_dir = resume
    run_dir = (run_dir or (Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg.method.name))).resolve()
    tag = new_tag()
    with on_signals():
        try:
            with RunLock(run_dir, tag) as lock:  # before anything starts; refuses a directory in use
                if resume is None:
                    refuse_existing_run(run_dir)
                else:
                    require_checkpoint(run_dir)
                with Processes(tag, keep_fds=[lock.fd] if lock.fd is not None else []) as procs:
                    return _run(procs, cfg, overrides, run_dir, resume, quiet)
        except Interrupted as stop:
            report_interrupt(stop, run_dir, LAUNCH, overrides)
            raise


def _run(procs: Processes, cfg: DictConfig, overrides: list[str], run_dir: Path, resume: Path | None,
         quiet: bool) -> dict[str, Any]:
    flwr_home = run_dir / ".flwr"
    run_config = write_run_config(flwr_home / "run_config.toml", overrides, run_dir, resume)
    federation = (f"num-supernodes={int(cfg.num_clients)} backend=\"ray\" "
                  f"client-resources-num-cpus={max(1, int(cfg.simulation.num_cpus))} "
                  f"client-resources-num-gpus={float(cfg.simulation.num_gpus)} "
                  "init-args-logging-level=\"ERROR\" init-args-log-to-driver=true")
    env = start_superlink(procs, flwr_home, run_dir / "superlink.log",
                          ray_address=cfg.simulation.get("ray_address"))
    app = stage_app(flwr_home / "app")
    job = FlowerJob(procs, env, CONNECTION, run_dir / "flwr_run.log", echo=not quiet)
    return run_flower_job(job, app, run_config, run_dir, ["--federation-config", federation],
                          see=f" and {run_dir}/superlink.log")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhm_flwr.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method.tau=2 levels.ratios=[1,0.5]")
    parser.add_argument("--run-dir", type=Path, help="absolute run directory (default: outputs/<date>/<time>-<method>)")
    parser.add_argument("--resume", type=Path, help="continue the run stored in this run directory")
    args = parser.parse_args(argv)
    try:
        summary = run_job(split_overrides(args.overrides), args.run_dir, args.resume)
    except (ConfigError, FileExistsError) as err:  # FileExistsError includes RunDirectoryBusy
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        return stop.exit_code
    except KeyboardInterrupt:  # before anything started
        return 130
    acc = summary.get("final_acc/global")
    print(f"run complete: final global accuracy {acc if acc is None else f'{acc:.4f}'}; "
          f"outputs in {summary['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
