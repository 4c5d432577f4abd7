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
   failure (:class:`RunFailed`, whose last line names the first ServerApp / client error). On
   Ctrl-C / SIGTERM / SIGHUP it first stops the Flower run (``flwr stop <id>``), keeps the last
   complete checkpoint and raises :class:`RunInterrupted` with the command that resumes the run
   (in the caller's terms, :class:`Commands`); this module prints it and exits 128 + the signal
   number (130 for Ctrl-C, 143 for SIGTERM). If the launcher is killed outright, the watchdog
   stops everything within seconds.

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
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fedhm_flwr.data.files import check_data_available
from fedhm_flwr.config import ConfigError, compose_config, load_config, resume_config, split_overrides
from fedhm_flwr.procs import Interrupted, Processes, RunLock, kill_serverapp, killpg_quietly, new_tag, on_signals
from fedhm_flwr.results import CHECKPOINT_DIR, SUMMARY_FILE, load_checkpoint_state, refuse_existing_run

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
#: Flower's line before the traceback of a ServerApp (deployment) / simulation (its ServerApp) exception
APP_RAISED = re.compile(r"\b(ServerApp|Simulation) raised an exception")
#: the strategy's warnings about a node's error (strategies/base.py, strategies/nodes.py)
NODE_ERROR = re.compile(r"(round \d+: node \S+ failed: .+|node \S+ cannot take part: .+)$")
#: the line of a Python traceback that names the exception: ``ValueError: ...``, ``flwr.x.Error: ...``
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$")
#: a node's error reason that only wraps the client's exception (the simulation's Ray actor error)
WRAPPED = re.compile(r"<class '[\w.]+\.\w+(?:\([\w.]+\))?'>:?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ErrorScan:
    """The first errors in a run's streamed output: the ServerApp's exception (the exception line
    of the traceback Flower logs after "ServerApp / Simulation raised an exception") and the first
    error of a node (the strategy's "node ... failed: <reason>" / "cannot take part" warnings:
    the client's exception, e.g. an unreadable image with its path). One line each."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.server: str | None = None
        self.client: str | None = None
        self.say = say  # told each first error at once (the console of a quiet run), one line
        self._in_traceback = False
        self._client_head: str | None = None
        self._client_lines = 0

    def _tell_client(self, text: str) -> None:
        self.client = " ".join(text.split())[:600]
        self._client_head = None
        if self.say is not None:
            self.say(f"first client error: {self.client}")

    def feed(self, line: str) -> None:
        text = ANSI.sub("", line).rstrip()
        if self.client is None:
            if self._client_head is not None:  # the reason was a wrapper: the client's own exception follows
                self._client_lines += 1
                if EXCEPTION_LINE.match(text.strip()) or self._client_lines > 80:
                    self._tell_client(f"{self._client_head} {text.strip() if self._client_lines <= 80 else ''}")
            elif match := NODE_ERROR.search(text):
                found = match.group(1)
                if WRAPPED.search(found):  # Ray's "<class 'ray.exceptions.RayTaskError(...)'>:<..." + traceback
                    self._client_head, self._client_lines = found[:found.index(WRAPPED.search(found).group(0))], 0
                else:
                    self._tell_client(found)
        if self.server is None:
            if APP_RAISED.search(text):
                self._in_traceback = True
            elif self._in_traceback and EXCEPTION_LINE.match(text.strip()):
                self.server = text.strip()[:600]
                self._in_traceback = False
                if self.say is not None:
                    self.say(f"ServerApp error: {self.server}")

    def reason(self) -> str | None:
        """One line: why the run failed, as far as its output says."""
        parts = ([f"ServerApp: {self.server}"] if self.server else []) + (
            [f"first client error: {self.client}"] if self.client else [])
        return "; ".join(parts) or None


class FlowerJob:
    """One ``flwr run`` of the app on a SuperLink connection, judged by its own run id.

    ``env`` is the CLI's environment (``FLWR_HOME`` holding a ``config.toml`` that names
    ``connection``); every CLI process is started through ``procs`` (tagged, own session)."""

    def __init__(self, procs: Processes, env: dict[str, str], connection: str, log_file: Path,
                 echo: bool = True, on_error: Callable[[str], None] | None = None) -> None:
        self.procs, self.env, self.connection, self.log_file, self.echo = procs, env, connection, log_file, echo
        self.run_id: int | None = None
        self.errors = ErrorScan(on_error)  # on_error: told the first errors as they appear (quiet runs)

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
                    line = raw.decode(errors="replace")
                    self.errors.feed(line)
                    if self.run_id is None and (match := STARTED_RUN.search(line)):
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


# --------------------------------------------------------------------------- how a run ends


@dataclass(frozen=True)
class Commands:
    """What the user types to resume a run (``resume`` + the run directory) or to start it again
    (``start`` + the overrides + ``--run-dir`` the run directory), in the terms they started it
    with: ``fedhm resume DIR`` after ``fedhm run`` / ``make run``, ``python -m fedhm_flwr.launch
    --resume DIR`` after that module, ``scripts/deploy_local.py ... --resume DIR`` after a deployment.
    ``cwd``: a folder to change to first (``python -m`` of a checkout that is not installed)."""

    resume: tuple[str, ...]
    start: tuple[str, ...]
    cwd: Path | None = None

    def _line(self, words: Sequence[str]) -> str:
        return (f"cd {shlex.quote(str(self.cwd))} && " if self.cwd else "") + shlex.join(words)

    def resume_line(self, run_dir: Path) -> str:
        return self._line([*self.resume, str(run_dir)])

    def start_line(self, overrides: Sequence[str], run_dir: Path | None) -> str:
        return self._line([*self.start, *overrides, *(["--run-dir", str(run_dir)] if run_dir else [])])


class PythonCommands(Commands):
    """The Python API's terms: ``fedhm_flwr.api.resume(DIR)`` / ``fedhm_flwr.api.run([...], run_dir=DIR)``."""

    def resume_line(self, run_dir: Path) -> str:
        return f"fedhm_flwr.api.resume({str(run_dir)!r})"

    def start_line(self, overrides: Sequence[str], run_dir: Path | None) -> str:
        return f"fedhm_flwr.api.run({list(overrides)!r}" + (f", run_dir={str(run_dir)!r})" if run_dir else ")")


def fedhm_program() -> tuple[str, ...]:
    """How to call this environment's ``fedhm`` command: ``fedhm`` when that is what the shell
    finds, else the script's absolute path (a virtualenv that is not activated, ``make``), else
    ``python -m fedhm_flwr``."""
    script = Path(sys.executable).parent / "fedhm"
    found = shutil.which("fedhm")
    if script.is_file():
        return ("fedhm",) if found and Path(found).resolve() == script.resolve() else (str(script),)
    return (sys.executable, "-m", "fedhm_flwr")


def fedhm_commands() -> Commands:
    """``fedhm resume DIR`` / ``fedhm run ... --run-dir DIR`` (``fedhm run``, ``make run``)."""
    program = fedhm_program()
    return Commands((*program, "resume"), (*program, "run"))


LAUNCH = (sys.executable, "-m", "fedhm_flwr.launch")
LAUNCH_COMMANDS = Commands((*LAUNCH, "--resume"), LAUNCH, APP_DIR)


def checkpoint_round(run_dir: Path) -> int | None:
    """The round of the run directory's last complete checkpoint, None if there is none."""
    try:
        return int(load_checkpoint_state(run_dir)["round"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def resume_hint(run_dir: Path, commands: Commands, overrides: Sequence[str]) -> tuple[str, str | None, int | None]:
    """(what to type to continue the run, the resume command or None, the checkpoint's round or None).

    Without a checkpoint: the command that starts the run again (into the same directory when
    nothing of it is there yet)."""
    saved = checkpoint_round(run_dir)
    if saved is None:
        try:
            refuse_existing_run(run_dir)
            again = commands.start_line(overrides, run_dir)
        except FileExistsError:  # rows but no checkpoint (checkpoint.every > rounds done): a new directory
            again = commands.start_line(overrides, None)
        return ("no checkpoint was written yet, so there is nothing to resume; start the run again with:\n"
                f"  {again}", None, None)
    command = commands.resume_line(run_dir)
    return (f"the last complete checkpoint (round {saved}) is in {run_dir / CHECKPOINT_DIR}; "
            f"resume the run with:\n  {command}", command, saved)


class RunInterrupted(Interrupted):
    """A run stopped by SIGINT / SIGTERM / SIGHUP, raised once every process it started is gone.

    ``run_dir``; ``checkpoint_round`` (the last complete checkpoint, None when none was written);
    ``resume_command`` (what continues it, in the caller's terms; None without a checkpoint);
    ``exit_code`` 128 + the signal number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP). ``str()`` is
    the report the commands print. A :class:`KeyboardInterrupt`, as an interrupt should be."""

    def __init__(self, signum: int, run_dir: Path, hint: str, resume_command: str | None,
                 checkpoint_round: int | None) -> None:
        super().__init__(signum)
        self.run_dir, self.hint = run_dir, hint
        self.resume_command, self.checkpoint_round = resume_command, checkpoint_round

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"{name} received: stopped the Flower run and every process it started.\n{self.hint}"


class RunFailed(RuntimeError):
    """A run that did not complete: ``run_dir``, ``reason`` (one line: the ServerApp's exception
    and/or the first client error found in Flower's output, None if it shows none), ``log``
    (Flower's output), ``resume_command`` (None without a checkpoint). ``str()`` ends with the
    reason's line."""

    def __init__(self, message: str, run_dir: Path | None = None, reason: str | None = None,
                 log: Path | None = None, resume_command: str | None = None) -> None:
        self.message, self.run_dir, self.reason, self.log = message, run_dir, reason, log
        self.resume_command = resume_command
        super().__init__(message)

    def __str__(self) -> str:
        lines = [self.message]
        if self.resume_command:
            lines.append(f"after fixing the cause, resume the run from its last checkpoint with: {self.resume_command}")
        lines.append(f"why: {self.reason}" if self.reason else f"why: Flower's output names no error; see {self.log}")
        return "\n".join(lines)


def run_flower_job(job: FlowerJob, app: Path, run_config: Path, run_dir: Path, extra: Sequence[str] = (),
                   timeout: float | None = None, see: str = "", commands: Commands | None = None) -> dict[str, Any]:
    """Run ``job`` to its end and return the summary the run wrote.

    Raises :class:`RunFailed` unless ``flwr run`` exited 0, this run's own status is
    ``finished:completed`` and ``summary.json`` was written by this run (with the first error of
    the ServerApp or a client that Flower's output shows, and the resume command in ``commands``'
    terms when a checkpoint is there). On a timeout or an interrupt (Ctrl-C, :class:`Interrupted`)
    the Flower run is stopped first (``flwr stop``)."""
    started = time.time()

    def failed(message: str) -> RunFailed:
        resume = resume_hint(run_dir, commands, [])[1] if commands is not None else None
        return RunFailed(f"{message}; Flower's output: {job.log_file}{see}", run_dir, job.errors.reason(),
                         job.log_file, resume)

    try:
        code = job.run(app, run_config, extra, timeout)
    except TimeoutError as err:
        job.stop()
        raise failed(str(err)) from None
    except KeyboardInterrupt:
        job.stop()
        raise
    status = job.status()
    summary_file = run_dir / SUMMARY_FILE
    fresh = summary_file.is_file() and summary_file.stat().st_mtime >= started - 1
    if code != 0 or status != "finished:completed" or not fresh:
        raise failed(f"the run did not complete (flwr run exit {code}, run {job.run_id}, status {status!r}, "
                     f"summary {'written' if fresh else 'not written'} by this run)")
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


def interrupted(stop: Interrupted, run_dir: Path, commands: Commands, overrides: Sequence[str]) -> RunInterrupted:
    """The :class:`RunInterrupted` of a run whose processes are all stopped."""
    hint, command, saved = resume_hint(run_dir, commands, overrides)
    return RunInterrupted(stop.signum, run_dir, hint, command, saved)


def require_checkpoint(run_dir: Path) -> None:
    """A resume needs a checkpoint: refused (ConfigError naming the folder) before anything starts."""
    if checkpoint_round(run_dir) is None:
        raise ConfigError("resume", str(run_dir), f"a run directory with a checkpoint ({run_dir / CHECKPOINT_DIR} "
                          "holds none: the run stopped before its first one): start it again")


def run_job(overrides: list[str], run_dir: Path | None = None, resume: Path | None = None,
            quiet: bool = False, commands: Commands | None = None,
            on_error: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Validate, run through ``flwr run``, verify; returns the run's summary.

    Raises ConfigError / FileExistsError (incl. RunDirectoryBusy) before anything starts,
    :class:`RunFailed` when the run fails and :class:`RunInterrupted` (after the cleanup) on
    SIGINT / SIGTERM / SIGHUP; their resume command is in ``commands``' terms (default:
    ``python -m fedhm_flwr.launch --resume DIR``). ``on_error`` is told the run's first ServerApp
    error and first client error (one line each) as soon as Flower's output shows them."""
    commands = commands or LAUNCH_COMMANDS
    if resume is not None:
        resume = resume.resolve()
        require_checkpoint(resume)  # before anything else: a resume without a checkpoint is refused at once
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
                    return _run(procs, cfg, overrides, run_dir, resume, quiet, commands, on_error)
        except Interrupted as stop:
            raise interrupted(stop, run_dir, commands, overrides if resume is None else []) from None


def _run(procs: Processes, cfg: DictConfig, overrides: list[str], run_dir: Path, resume: Path | None,
         quiet: bool, commands: Commands, on_error: Callable[[str], None] | None = None) -> dict[str, Any]:
    flwr_home = run_dir / ".flwr"
    run_config = write_run_config(flwr_home / "run_config.toml", overrides, run_dir, resume)
    federation = (f"num-supernodes={int(cfg.num_clients)} backend=\"ray\" "
                  f"client-resources-num-cpus={max(1, int(cfg.simulation.num_cpus))} "
                  f"client-resources-num-gpus={float(cfg.simulation.num_gpus)} "
                  "init-args-logging-level=\"ERROR\" init-args-log-to-driver=true")
    env = start_superlink(procs, flwr_home, run_dir / "superlink.log",
                          ray_address=cfg.simulation.get("ray_address"))
    app = stage_app(flwr_home / "app")
    job = FlowerJob(procs, env, CONNECTION, run_dir / "flwr_run.log", echo=not quiet, on_error=on_error)
    return run_flower_job(job, app, run_config, run_dir, ["--federation-config", federation],
                          see=f" and {run_dir}/superlink.log", commands=commands)


def report_stop(stop: KeyboardInterrupt) -> int:
    """After an interrupt: the report (stderr) and the exit code, 128 + the signal number."""
    if isinstance(stop, RunInterrupted):
        print(f"\n{stop}", file=sys.stderr, flush=True)
    elif isinstance(stop, Interrupted):
        print(f"\n{signal.Signals(stop.signum).name} received before the run started: nothing was started.",
              file=sys.stderr, flush=True)
    return stop.exit_code if isinstance(stop, Interrupted) else 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhm_flwr.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method.tau=2 levels.ratios=[1,0.5]")
    parser.add_argument("--run-dir", type=Path, help="absolute run directory (default: outputs/<date>/<time>-<method>)")
    parser.add_argument("--resume", type=Path, help="continue the run stored in this run directory")
    args = parser.parse_args(argv)
    try:
        with on_signals():  # from here on SIGINT / SIGTERM / SIGHUP end the command cleanly
            summary = run_job(split_overrides(args.overrides), args.run_dir, args.resume)
    except (ConfigError, FileExistsError) as err:  # FileExistsError includes RunDirectoryBusy
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # RunFailed: ends with the one line that says why
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # RunInterrupted (everything stopped, resume command), or before the start
        return report_stop(stop)
    acc = summary.get("final_acc/global")
    print(f"run complete: final global accuracy {acc if acc is None else f'{acc:.4f}'}; "
          f"outputs in {summary['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
