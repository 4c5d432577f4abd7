"""Run one job through ``flwr run`` on Flower's Ray-backed simulation engine, safely.

``python -m fedhm_flwr.launch [HYDRA OVERRIDES ...]`` (what ``make run`` calls):

1. composes and validates the Hydra config (a bad value stops here, before anything starts);
2. starts a private SuperLink in simulation mode on a free loopback port, with its own
   ``FLWR_HOME`` inside the run directory and runtime dependency installation disabled;
3. stages the app's own files (packages, Hydra tree, metadata) next to the run and runs
   ``flwr run <staged app> <connection> --stream`` with the overrides and the absolute run
   directory as run-config, and ``num-supernodes`` / client resources from the config;
4. checks the run's final status with ``flwr list --format json`` (``--stream`` exits 0 even
   when a run failed) and that the run wrote its summary;
5. stops the SuperLink it started (its whole process group), also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from fedhm_flwr.config import ConfigError, load_config, resume_config, split_overrides
from fedhm_flwr.results import refuse_existing_run

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


class SuperLink:
    """A private simulation SuperLink (context manager; stopped by process group on exit)."""

    def __init__(self, flwr_home: Path, port: int, log_file: Path) -> None:
        self.flwr_home, self.port, self.log_file = flwr_home, port, log_file
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            # Flower starts its helpers (flower-superexec, flwr-serverapp, ...) by name
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        })
        return env

    def __enter__(self) -> SuperLink:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "job"\n\n'
            f'[superlink.job]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        cmd = [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--database", str(self.flwr_home / "state.db"),
               "--disable-runtime-dependency-installation"]
        self.log_handle = self.log_file.open("ab")
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=self.log_handle, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"flower-superlink did not become ready in 60 s; see {self.log_file}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # children that left the group (Ray workers) are reaped by their own parents; make
        # sure nothing of the group is left behind
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log_handle.close()
        self.proc = None

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def run_job(overrides: list[str], run_dir: Path | None = None, resume: Path | None = None,
            quiet: bool = False) -> dict[str, Any]:
    """Validate, run through ``flwr run``, verify; returns the run's summary."""
    # refuse bad values before anything starts
    cfg = resume_config(resume, overrides) if resume is not None else load_config(overrides)
    if resume is not None:
        run_dir = resume
    run_dir = (run_dir or (Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg.method.name))).resolve()
    if resume is None:
        refuse_existing_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = run_dir / ".flwr"
    run_config = flwr_home / "run_config.toml"
    flwr_home.mkdir(parents=True, exist_ok=True)
    run_config.write_text(
        f"overrides = {toml_string(' '.join(shlex.quote(o) for o in overrides))}\n"
        f"output-dir = {toml_string(str(run_dir))}\n"
        f"resume = {toml_string(str(resume) if resume else '')}\n"
    )
    federation = (f"num-supernodes={int(cfg.num_clients)} backend=\"ray\" "
                  f"client-resources-num-cpus={max(1, int(cfg.simulation.num_cpus))} "
                  f"client-resources-num-gpus={float(cfg.simulation.num_gpus)} "
                  "init-args-logging-level=\"ERROR\" init-args-log-to-driver=true")
    with SuperLink(flwr_home, free_port(), run_dir / "superlink.log") as link:
        env = link.env()
        app = stage_app(flwr_home / "app")
        cmd = [_bin("flwr"), "run", str(app), "job", "--stream", "--run-config", str(run_config),
               "--federation-config", federation]
        out = None if not quiet else (run_dir / "flwr_run.log").open("wb")
        try:
            code = subprocess.call(cmd, env=env, cwd=APP_DIR, stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()
        status = run_status(env)
    summary_file = run_dir / "summary.json"
    if code != 0 or status.get("status") not in ("finished:completed", None) or not summary_file.is_file():
        raise RuntimeError(f"the run did not complete (flwr run exit {code}, status {status.get('status')!r}, "
                           f"summary {'present' if summary_file.is_file() else 'missing'}); "
                           f"see {run_dir}/superlink.log")
    return json.loads(summary_file.read_text())


def run_status(env: dict[str, str]) -> dict[str, Any]:
    """The last run's status from ``flwr list --format json`` (empty dict if unavailable)."""
    try:
        out = subprocess.run([_bin("flwr"), "list", "job", "--format", "json"], env=env, cwd=APP_DIR,
                             capture_output=True, text=True, timeout=60).stdout
        runs = json.loads(out[out.index("{"):]).get("runs", [])
    except (ValueError, subprocess.SubprocessError, OSError):
        return {}
    return runs[-1] if runs else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhm_flwr.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method.tau=2 levels.ratios=[1,0.5]")
    parser.add_argument("--run-dir", type=Path, help="absolute run directory (default: outputs/<date>/<time>-<method>)")
    parser.add_argument("--resume", type=Path, help="continue the run stored in this run directory")
    args = parser.parse_args(argv)
    try:
        summary = run_job(split_overrides(args.overrides), args.run_dir, args.resume)
    except (ConfigError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    acc = summary.get("final_acc/global")
    print(f"run complete: final global accuracy {acc if acc is None else f'{acc:.4f}'}; "
          f"outputs in {summary['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
