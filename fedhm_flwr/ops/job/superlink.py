"""Flower's side of a job: the app bundle, the SuperLink, the CLI's connection and run config.

Shared by the launcher (``fedhm run``: a private simulation SuperLink, :func:`start_simulation_superlink`)
and ``fedhm deploy-local`` (a SuperLink with TLS and SuperNode authentication on loopback,
:mod:`fedhm_flwr.ops.deploy.loopback`): both start ``flower-superlink`` through :func:`start_superlink`,
name it in the CLI's ``config.toml`` (:func:`write_connection`) and run the staged app
(:func:`stage_app`) with a run-config file (:func:`write_run_config`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedhm_flwr.ops.job.outcome import exit_status
from fedhm_flwr.ops.job.procs import Processes
from fedhm_flwr.reporting.provenance import code_version, stamp_app

APP_DIR = Path(__file__).resolve().parents[3]

#: what the Flower app bundle needs: the project's packages, its Hydra tree and its metadata
APP_CONTENT = ("pyproject.toml", "README.md", "fedhm_flwr", "strategies", "clients", "conf")


def stage_app(dest: Path) -> Path:
    """Copy the app's own files to ``dest`` and return it.

    ``flwr run <dir>`` walks the whole folder to build the app bundle: in a checkout that is also
    the virtualenv (GBs) and every earlier output, seconds of work per run. A staged copy holds
    only what the bundle needs (and is exactly what ran, kept with the run's outputs). The copy's run
    config carries the clone's git commit (:func:`~fedhm_flwr.reporting.provenance.stamp_app`): the
    ServerApp runs from Flower's installed copy, outside the clone, and records it from there."""
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
    stamp_app(dest / "pyproject.toml", code_version(APP_DIR))
    return dest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bin_path(name: str) -> str:
    """An executable of this Python environment (works without an activated venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def flower_env(flwr_home: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) for a Flower process or CLI with its own ``FLWR_HOME``:
    nothing installed at run time, no update check or telemetry, unbuffered output, and this
    environment's ``bin`` first on ``PATH`` (Flower starts ``flower-superexec``, ``flwr-serverapp``,
    ``flwr-clientapp`` by name, also where the virtualenv is not activated: ``make``)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        }
    )
    return env


def toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def write_connection(cli_home: Path, name: str, address: str, root_certificates: Path | None = None) -> Path:
    """The CLI's ``$FLWR_HOME/config.toml`` naming one SuperLink connection, the default one
    (TLS with ``root_certificates``, else insecure)."""
    cli_home.mkdir(parents=True, exist_ok=True)
    trust = (
        f"root-certificates = {toml_string(str(root_certificates))}\n"
        if root_certificates is not None
        else "insecure = true\n"
    )
    path = cli_home / "config.toml"
    path.write_text(f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{trust}')
    return path


def write_run_config(path: Path, overrides: Sequence[str], run_dir: Path, resume: Path | None = None) -> Path:
    """The run-config file of ``flwr run --run-config`` (keys of ``[tool.flwr.app.config]``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"overrides = {toml_string(' '.join(shlex.quote(o) for o in overrides))}\n"
        f"output-dir = {toml_string(str(run_dir))}\n"
        f"resume = {toml_string(str(resume) if resume else '')}\n"
    )
    return path


@dataclass(frozen=True)
class Tls:
    """A SuperLink's TLS files: the CA certificate, its own certificate and key."""

    ca: Path
    cert: Path
    key: Path


#: how long a SuperLink the launcher or deploy-local starts may take to start its helper (a loaded machine)
GUARD_HELPER_WAIT = 90.0
#: the module the SuperLink runs under (its process's name, as :func:`fedhm_flwr.ops.job.procs.command_name` gives it)
GUARD_MODULE = "fedhm_flwr.ops.deploy.link_guard"


def start_superlink(
    procs: Processes,
    port: int,
    database: Path,
    env: dict[str, str],
    log_file: Path,
    *,
    tls: Tls | None = None,
    simulation: bool = False,
    supernode_auth: bool = False,
    cwd: Path | None = None,
    timeout: float = 60,
    wait: bool = True,
) -> subprocess.Popen[bytes]:
    """``flower-superlink`` on ``127.0.0.1:port`` (all its APIs), runtime dependency installation
    disabled, started through ``procs`` (tagged, own session); returns once its ``/health`` answers
    (:func:`await_health`), or at once without ``wait``. ``simulation``: Flower's simulation engine in a
    subprocess; ``supernode_auth``: only registered SuperNode keys may connect. It runs under ``fedhm
    superlink`` (:mod:`fedhm_flwr.ops.deploy.link_guard`): a SuperLink whose ``flower-superexec`` died
    (or never started) cannot start a run, and would stay up silently; the guard then says why in its
    log, stops it and exits 1, so that the process watching it (the launcher, ``deploy-local``) sees it end."""
    guard = [sys.executable, "-m", GUARD_MODULE, "--helper-wait", f"{GUARD_HELPER_WAIT:g}"]
    cmd = [*guard, "--flower-superlink", bin_path("flower-superlink"), "--"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]
    if simulation:
        cmd += ["--simulation", "--isolation", "subprocess"]
    if supernode_auth:
        cmd.append("--enable-supernode-auth")
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database",
        str(database),
        "--disable-runtime-dependency-installation",
    ]
    # `python -m fedhm_flwr...` of this checkout, also where another one is installed
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(APP_DIR), env.get("PYTHONPATH", "")) if p)}
    proc = procs.start("superlink", cmd, env, log_file, cwd=cwd)
    if wait:
        await_health(port, log_file, tls=tls, proc=proc, timeout=timeout)
    return proc


def await_health(
    port: int,
    log_file: Path,
    *,
    tls: Tls | None = None,
    proc: subprocess.Popen[bytes] | None = None,
    timeout: float = 60,
) -> None:
    """Return once the SuperLink on ``127.0.0.1:port`` answers ``/health`` (over TLS, checking its
    certificate against ``tls.ca``); raises, with the end of its log, when it does not within ``timeout`` s
    or when ``proc`` (the SuperLink, where this process started it) ends first."""
    context = ssl.create_default_context(cafile=str(tls.ca)) if tls is not None else None
    url = f"{'https' if tls is not None else 'http'}://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"flower-superlink ended during its start ({exit_status(proc.returncode)}); the last "
                f"lines of {log_file}:\n{log_tail(log_file)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"flower-superlink not ready in {timeout:.0f} s:\n{log_tail(log_file)}")


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


#: Ray's settings for a local instance that a job starts: no idle worker processes started ahead for the
#: first driver (each imports Ray, ~0.7 s of CPU, and the clients run in actors, which get workers of their own)
RAY_QUIET_START = {"RAY_prestart_worker_first_driver": "0"}

#: name of the private SuperLink in the launcher's FLWR_HOME/config.toml
SIMULATION_CONNECTION = "job"


def superlink_env(flwr_home: Path, port: int, ray_address: str | None = None) -> dict[str, str]:
    """Environment of the private simulation SuperLink and of the ``flwr`` CLI talking to it.

    ``RAY_ADDRESS`` reaches ``ray.init`` in ``flwr-simulation`` (Flower's Ray backend calls it with
    its ``init_args``, and the federation config carries no address): ``ray_address``
    (``simulation.ray_address``: ``auto`` or ``HOST:PORT``) runs the clients on that cluster;
    without one, ``local``, a private Ray instance even where a cluster runs on this machine
    (plain ``ray.init()`` would join the last one started here)."""
    env = flower_env(flwr_home)
    env.update(
        {
            "RAY_ADDRESS": ray_address or "local",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )
    for key, value in RAY_QUIET_START.items():
        env.setdefault(key, value)  # (a value in the caller's environment wins)
    return env


def connect_simulation_superlink(flwr_home: Path, port: int) -> dict[str, str]:
    """The CLI's environment for the simulation SuperLink on ``127.0.0.1:port``: its ``config.toml``
    in ``flwr_home`` names it as :data:`SIMULATION_CONNECTION`."""
    write_connection(flwr_home, SIMULATION_CONNECTION, f"127.0.0.1:{port}")
    return superlink_env(flwr_home, port)


def start_simulation_superlink(
    procs: Processes,
    flwr_home: Path,
    log_file: Path,
    timeout: float = 60,
    ray_address: str | None = None,
    port: int | None = None,
    wait: bool = True,
) -> dict[str, str]:
    """A simulation SuperLink on ``port`` (default: a free loopback port); returns the CLI's environment
    once it answers (at once without ``wait``: :func:`await_health` then waits for it).
    Its simulations run their clients on the Ray cluster at ``ray_address`` (see :func:`superlink_env`)."""
    port = port or free_port()
    write_connection(flwr_home, SIMULATION_CONNECTION, f"127.0.0.1:{port}")
    env = superlink_env(flwr_home, port, ray_address)
    start_superlink(procs, port, flwr_home / "state.db", env, log_file, simulation=True, timeout=timeout, wait=wait)
    return env
