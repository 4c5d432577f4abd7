"""A SuperLink with TLS and SuperNode authentication plus SuperNodes, all on loopback.

:class:`LocalDeployment` does what an operator does for a federation of real devices, each
machine replaced by a process on 127.0.0.1 (``fedhm deploy-local``, :mod:`fedhm_flwr.ops.deploy.deploy_local`,
and the deployment tests drive it): credentials (:mod:`fedhm_flwr.ops.deploy.credentials`), the SuperLink
(:func:`fedhm_flwr.ops.job.superlink.start_superlink`, as the launcher starts its own), registration of
every SuperNode's key, SuperNodes through ``fedhm supernode`` with their node configs, the job
through the launcher's runner (:func:`fedhm_flwr.ops.job.flower_job.run_flower_job`), and the stop of
every process it started (tagged, watched: :mod:`fedhm_flwr.ops.job.procs`).

Node configs (:func:`node_config`): ``partition-id``, ``num-partitions``, optionally ``data-dir``
and a declared capability (:func:`parse_capability`: ``level=0.5``, ``params=20000``,
``macs=4e5``, ``memory=6.5e6`` or ``memory=64M``, ``-`` for none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedhm_flwr.core.protocol import (
    CAPABILITY,
    CAPABILITY_BUDGETS,
    CAPABILITY_LEVEL,
    DATA_DIR,
    NUM_PARTITIONS,
    PARTITION_ID,
)
from fedhm_flwr.ops.deploy.credentials import DEFAULT_SANS, Credentials, create_credentials
from fedhm_flwr.ops.job.flower_job import FlowerJob, run_flower_job
from fedhm_flwr.ops.job.outcome import Commands, RunFailed, exit_status
from fedhm_flwr.ops.job.procs import TAG_VAR, Processes, alive, new_tag, tagged_pids
from fedhm_flwr.ops.job.superlink import (
    APP_DIR,
    Tls,
    bin_path,
    flower_env,
    free_port,
    log_tail,
    stage_app,
    start_superlink,
    toml_string,
    write_connection,
    write_run_config,
)

CONNECTION = "fedhm-local"  # name of the SuperLink connection in the CLI's config.toml
CAPABILITY_KINDS = (CAPABILITY_LEVEL, *CAPABILITY_BUDGETS)


def say(message: str) -> None:
    print(f"[deploy-local] {message}", flush=True)


def label(name: str) -> str:
    """A process of the deployment in words, from the name it was started under."""
    if name == "superlink":
        return "the SuperLink (flower-superlink)"
    return "flwr run" if name == "flwr-run" else f"SuperNode {name} (fedhm supernode)"


# --------------------------------------------------------------------------- node configs


_SUFFIX = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_capability(spec: str) -> dict[str, float]:
    """``level=0.5`` -> ``{"capability-level": 0.5}``; ``memory=64M`` -> bytes; ``-`` -> nothing."""
    spec = spec.strip()
    if spec in ("-", "", "none"):
        return {}
    kind, sep, raw = spec.partition("=")
    if not sep or kind not in CAPABILITY_KINDS:
        raise ValueError(
            f"capability {spec!r}: expected one of {', '.join(k + '=VALUE' for k in CAPABILITY_KINDS)} or '-'"
        )
    raw = raw.strip()
    scale = 1.0
    if raw and raw[-1] in _SUFFIX:
        raw, scale = raw[:-1], _SUFFIX[raw[-1]]
    try:
        value = float(raw) * scale
    except ValueError:
        raise ValueError(f"capability {spec!r}: {raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"capability {spec!r}: the value must be positive")
    return {CAPABILITY + kind: value}


def node_config(
    partition_id: int, num_partitions: int, capability: dict[str, float] | None = None, data_dir: str | None = None
) -> dict[str, Any]:
    """The node config of one SuperNode (what ``fedhm_flwr/client/handlers.py`` reads)."""
    config: dict[str, Any] = {PARTITION_ID: int(partition_id), NUM_PARTITIONS: int(num_partitions)}
    if data_dir:
        config[DATA_DIR] = str(data_dir)
    config.update(capability or {})
    return config


def node_config_toml(config: dict[str, Any]) -> str:
    """A flat TOML file (``flower-supernode --node-config FILE.toml``)."""
    lines = []
    for key, value in config.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{key} = {value!r}")
        else:
            lines.append(f"{key} = {toml_string(str(value))}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the deployment


class LocalDeployment:
    """A SuperLink with TLS and SuperNode authentication plus SuperNodes, all on loopback.

    Use as a context manager: leaving the ``with`` block stops every process it started.
    """

    def __init__(
        self,
        work_dir: Path,
        port: int | None = None,
        tag: str | None = None,
        say: Callable[[str], None] = say,
        keep_fds: Sequence[int] = (),
    ) -> None:
        self.work_dir = work_dir.resolve()
        self.port = port or free_port()
        self.tag = tag or new_tag()
        self.say = say
        self.processes = Processes(self.tag, keep_fds=keep_fds)  # and its watchdog
        self.creds = Credentials(self.work_dir)
        self.logs = self.work_dir / "logs"
        self.cli_home = self.work_dir / "cli"  # FLWR_HOME of the operator's flwr CLI
        self.supernodes: dict[str, subprocess.Popen[bytes]] = {}
        self.node_ids: dict[str, int] = {}
        self.leftovers: list[int] = []
        self.superlink: subprocess.Popen[bytes] | None = None
        self.job: FlowerJob | None = None

    # -- plumbing

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, flwr_home: Path) -> dict[str, str]:
        """The environment of a process of this deployment (its own ``FLWR_HOME``, the job's tag)."""
        return {**flower_env(flwr_home), TAG_VAR: self.tag}

    def flwr(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        """Run a ``flwr`` CLI command with ``--format json`` against this SuperLink; its JSON answer."""
        cmd = [bin_path("flwr"), *args, CONNECTION, "--format", "json"]
        out = subprocess.run(
            cmd,
            env=self.env(self.cli_home),
            cwd=APP_DIR,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        text = out.stdout
        try:
            answer = json.loads(text[text.index("{") :])
        except ValueError:
            answer = {}
        if out.returncode != 0 or not answer.get("success", False):
            raise RuntimeError(
                f"`{' '.join(cmd[1:])}` failed (exit {out.returncode}): {(out.stdout + out.stderr).strip()[-1500:]}"
            )
        return answer

    def log_tail(self, name: str, lines: int = 25) -> str:
        return log_tail(self.logs / f"{name}.log", lines)

    def ended(self) -> list[tuple[str, Path]]:
        """The processes of this deployment that ended although they should still run (the SuperLink, a
        SuperNode, ``flwr run`` with an error): (what ended and how, its log) each."""
        found = []
        for name, proc, _ in self.processes.started:
            code = proc.poll()
            if code is None or (name == "flwr-run" and (code == 0 or (self.job is not None and self.job.timed_out))):
                continue  # running, or the job's own end (a timeout's kill is the error's first line)
            found.append((f"{label(name)} ended: {exit_status(code)}", self.logs / f"{name}.log"))
        return found

    def explain(self, err: RuntimeError) -> RuntimeError:
        """``err`` naming the processes of this deployment that ended, with their exit code or signal and
        the last lines of their logs (not those whose last lines ``err`` shows already): for a :class:`RunFailed`,
        as its reason, before what Flower's output said, if anything (a dead process is the likelier cause)."""
        ended = [(what, log) for what, log in self.ended() if f"last lines of {log}" not in str(err)]
        if not ended:
            return err
        line = "; ".join(what for what, _ in ended)
        tails = "\n".join(f"last lines of {log}:\n{log_tail(log, 15)}" for _, log in ended)
        if isinstance(err, RunFailed):
            err.reason = "; ".join(part for part in (line, err.reason) if part)
            err.details = "\n".join(part for part in (err.details, tails) if part)
            return err
        return RuntimeError(f"{err}\n{line}\n{tails}")

    # -- steps

    def make_credentials(self, node_names: Sequence[str], sans: Sequence[str] = DEFAULT_SANS) -> Credentials:
        self.creds = create_credentials(self.work_dir, node_names, sans)
        self.say(f"credentials in {self.work_dir} (CA, SuperLink certificate, {len(node_names)} SuperNode key pairs)")
        return self.creds

    def start_superlink(self, timeout: float = 90) -> subprocess.Popen[bytes]:
        """``flower-superlink`` with TLS and SuperNode authentication on this deployment's port, its
        state in ``superlink/state.db`` (registrations and runs survive a restart: started again
        after a stop, it is the same SuperLink); the CLI's connection names it."""
        server = self.creds.server_dir
        (server / "flwr-home").mkdir(parents=True, exist_ok=True)
        write_connection(self.cli_home, CONNECTION, self.address, server / "ca.pem")
        tls = Tls(server / "ca.pem", server / "server.pem", server / "server.key")
        proc = start_superlink(
            self.processes,
            self.port,
            server / "state.db",
            self.env(server / "flwr-home"),
            self.logs / "superlink.log",
            tls=tls,
            supernode_auth=True,
            cwd=server,
            timeout=timeout,
        )
        self.superlink = proc
        self.say(f"SuperLink up at https://{self.address} (TLS, SuperNode authentication on)")
        return proc

    def register(self, name: str) -> int:
        """Register a SuperNode's public key with the SuperLink; its node id."""
        answer = self.flwr("supernode", "register", str(self.creds.node_dir(name) / "node.pub"), "--name", name)
        self.node_ids[name] = int(answer["node-id"])
        return self.node_ids[name]

    def nodes(self) -> list[dict[str, Any]]:
        """``flwr supernode ls``: every registered SuperNode with its status."""
        return list(self.flwr("supernode", "ls").get("nodes", []))

    def start_supernode(
        self,
        name: str,
        config: dict[str, Any],
        *,
        with_ca: bool = True,
        max_retries: int | None = None,
        max_wait_time: float | None = None,
        extra_env: dict[str, str] | None = None,
        restart_wait: float | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start SuperNode ``name`` with its key, the CA certificate (unless ``with_ca=False``) and ``config``
        (``extra_env``: variables of the device's own environment, e.g. where its other data would be),
        as a device does: through ``fedhm supernode`` (:mod:`fedhm_flwr.ops.deploy.supernode`), which starts it
        again once if the SuperLink still holds the session of a killed predecessor (``restart_wait``:
        its wait, default the heartbeat window plus a margin; 0: no second start)."""
        folder = self.creds.node_dir(name)
        home = folder / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        (folder / "node-config.toml").write_text(node_config_toml(config))
        wrapper = [sys.executable, "-m", "fedhm_flwr.ops.deploy.supernode"]
        if restart_wait is not None:
            wrapper += ["--restart-wait", str(restart_wait)]
        cmd = [
            *wrapper,
            "--superlink",
            self.address,
            "--auth-supernode-private-key",
            str(folder / "node.key"),
            "--node-config",
            str(folder / "node-config.toml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
        ]
        if with_ca:
            cmd += ["--root-certificates", str(folder / "ca.pem")]
        if max_retries is not None:
            cmd += ["--max-retries", str(max_retries)]
        if max_wait_time is not None:
            cmd += ["--max-wait-time", str(max_wait_time)]
        env = {**self.env(home), **(extra_env or {})}
        # `python -m fedhm_flwr.ops.deploy.supernode` of this checkout, also where another one is installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(APP_DIR), env.get("PYTHONPATH", "")) if p)
        proc = self.processes.start(name, cmd, env, self.logs / f"{name}.log", cwd=folder)
        self.supernodes[name] = proc
        return proc

    def wait_online(self, names: Sequence[str], timeout: float = 120) -> None:
        """Until every named (registered) SuperNode is online; fails if one of them exits."""
        wanted = {str(self.node_ids[n]): n for n in names}
        deadline = time.monotonic() + timeout
        while True:
            for name in names:
                proc = self.supernodes[name]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{label(name)} ended before it was online ({exit_status(proc.returncode)}); "
                        f"the last lines of {self.logs / f'{name}.log'}:\n{self.log_tail(name)}"
                    )
            online = {str(n["node-id"]) for n in self.nodes() if n.get("status") == "online"}
            if set(wanted) <= online:
                self.say(f"{len(names)} SuperNode(s) online: {', '.join(names)}")
                return
            if time.monotonic() > deadline:
                missing = sorted(wanted[i] for i in set(wanted) - online)
                raise RuntimeError(f"SuperNodes not online after {timeout:.0f} s: {missing}")
            time.sleep(2.0)

    def run_job(
        self,
        overrides: Sequence[str],
        run_dir: Path,
        timeout: float | None = None,
        echo: bool = True,
        resume: Path | None = None,
        commands: Commands | None = None,
    ) -> dict[str, Any]:
        """The staged app through ``flwr run <app> <connection> --stream`` (the launcher's runner:
        own run id, final status, summary); returns ``summary.json``."""
        run_dir = run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        run_config = write_run_config(self.cli_home / "run-config.toml", overrides, run_dir, resume)
        app = stage_app(self.work_dir / "app")  # the app's own files, not tests/ bench/ scripts/ docs/
        self.say(f"flwr run {app} {CONNECTION} --stream --run-config {run_config}  (outputs in {run_dir})")
        job = self.job = FlowerJob(
            self.processes, self.env(self.cli_home), CONNECTION, self.logs / "flwr-run.log", echo
        )
        return run_flower_job(
            job, app, run_config, run_dir, timeout=timeout, see=f" and {self.logs}/superlink.log", commands=commands
        )

    def close(self) -> None:
        """Stop every process this deployment started (SuperNodes, then the SuperLink, then stragglers)."""
        self.leftovers = self.processes.close(grace=10.0, settle=3.0)
        if self.leftovers:
            self.say(f"stopped {len(self.leftovers)} process(es) that had left their group: {self.leftovers}")
        remaining = [p for p in tagged_pids(self.tag) if alive(p)]
        if remaining:
            self.say(f"WARNING: processes still running: {remaining}")

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
