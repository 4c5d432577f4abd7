#!/usr/bin/env python3
"""A real Flower deployment of fedhm-flwr on this machine: TLS, SuperNode authentication, N SuperNodes.

``python scripts/deploy_local.py --nodes N [--capabilities "SPEC ..."] [HYDRA OVERRIDES ...]``
(what ``make deploy-local N=... CAPS="..." ARGS="..."`` calls) does what an operator does for a
federation of real devices, with every machine replaced by a process on the loopback interface:

1. **credentials** (``<work>/ca``, ``<work>/superlink``, ``<work>/supernodes/node-<i>``): a
   certificate authority, a TLS certificate for the SuperLink signed by it (valid for
   ``localhost``, ``127.0.0.1``, ``::1`` and every ``--san``), and one EC P-384 key pair per
   SuperNode in OpenSSH format (what ``flower-supernode --auth-supernode-private-key`` and
   ``flwr supernode register`` read). Written with the ``cryptography`` package (a dependency of
   Flower), because one library makes both the X.509 certificates and the OpenSSH keys, which
   ``openssl`` alone cannot write; docs/DEPLOY.md gives the equivalent ``openssl`` /
   ``ssh-keygen`` commands for real machines;
2. **SuperLink**: ``flower-superlink`` with ``--ssl-*`` (TLS) and ``--enable-supernode-auth``
   (only SuperNodes whose public key was registered may connect), on one free loopback port
   that serves the Fleet, Control and Runtime APIs; runtime dependency installation disabled;
3. **registration**: ``flwr supernode register node-<i>/node.pub <connection>`` per SuperNode;
4. **SuperNodes**: ``flower-supernode --root-certificates ca.pem --auth-supernode-private-key
   node.key --node-config node-config.toml``, each with its own ``FLWR_HOME``, its own Runtime
   API port and a node config with ``partition-id``, ``num-partitions``, optionally ``data-dir``
   and a declared capability (``capability-level`` or a ``capability-params`` /
   ``capability-macs`` / ``capability-memory`` budget);
5. **the job**: the launcher's runner (``fedhm_flwr.launch.run_flower_job``): the staged app
   (only the app's own files) through ``flwr run <app> <connection> --stream`` with the Hydra
   overrides, judged by its own run id's final status (``--stream`` exits 0 even when a run
   fails) and its ``summary.json``; ``--resume <run dir>`` continues a stopped run;
6. **cleanup**: every process started here is stopped, also on failure, Ctrl-C or SIGTERM (the
   ServerApp first, then ``flwr stop <run id>``, the SuperNodes, the SuperLink; exit 130 / 143
   and the command that resumes the run): each runs in its own session and carries a unique
   tag in its environment, which its children inherit (``fedhm_flwr.procs``); a watchdog stops
   them all if this script is killed outright. The run directory is locked while in use.

Capability specs (``--capabilities``, one per node, cycled when fewer than N):
``level=0.5``, ``params=20000``, ``macs=4e5``, ``memory=6.5e6`` (bytes; k/M/G suffixes are
accepted: ``memory=64M``), or ``-`` (declare nothing: the node gets ``levels.default``, else
the configured assignment). Default: node i declares ``level=<levels.ratios[i mod L]>``.

Everything lands in the run directory: ``summary.json`` and ``metrics.jsonl`` of the run, and
``deploy/`` with the credentials, node configs and the logs of every process.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# the package of this checkout, also when another checkout is the one installed in the environment
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedhm_flwr.config import ConfigError, load_config, resume_config, split_overrides
from fedhm_flwr.launch import (Commands, FlowerJob, check_data, default_run_dir, free_port, interrupted, report_stop,
                               require_checkpoint, run_flower_job, stage_app, toml_string, write_run_config)
from fedhm_flwr.procs import TAG_VAR, Interrupted, Processes, RunLock, new_tag, on_signals, tagged_pids
from fedhm_flwr.procs import alive as _alive
from fedhm_flwr.results import refuse_existing_run

APP_DIR = Path(__file__).resolve().parent.parent
CONNECTION = "fedhm-local"  # name of the SuperLink connection in the CLI's config.toml
DEFAULT_SANS = ("localhost", "127.0.0.1", "::1")
CAPABILITY_KINDS = ("level", "params", "macs", "memory")


def _bin(name: str) -> str:
    """An executable of this Python environment (works without an activated venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _say(message: str) -> None:
    print(f"[deploy-local] {message}", flush=True)


# --------------------------------------------------------------------------- credentials


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def create_ca(directory: Path, days: int = 30, name: str = "fedhm-flwr deployment CA") -> tuple[Path, Path]:
    """A self-signed certificate authority: (``ca.pem``, ``ca.key``)."""
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.pem").write_bytes(_pem(cert))
    _write_private(directory / "ca.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory / "ca.pem", directory / "ca.key"


def create_server_certificate(directory: Path, ca_cert: Path, ca_key: Path, sans: Sequence[str] = DEFAULT_SANS,
                              days: int = 30) -> tuple[Path, Path]:
    """The SuperLink's TLS certificate signed by the CA, valid for ``sans``: (``server.pem``, ``server.key``).

    Each SAN is an IP address when it parses as one, else a DNS name. A SuperNode (and the
    ``flwr`` CLI) must reach the SuperLink under one of these names.
    """
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for san in dict.fromkeys(sans):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(sans[0]))]))
        .issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)
        .sign(signer, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "server.pem").write_bytes(_pem(cert))
    _write_private(directory / "server.key", key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return directory / "server.pem", directory / "server.key"


def create_node_keys(directory: Path, comment: str = "") -> tuple[Path, Path]:
    """A SuperNode's authentication key pair, EC P-384 in OpenSSH format: (``node.key``, ``node.pub``).

    The same as ``ssh-keygen -t ecdsa -b 384 -N "" -f node.key`` (``node.key.pub`` there).
    """
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(directory / "node.key", key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.OpenSSH,
                                                             serialization.NoEncryption()))
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (directory / "node.pub").write_bytes(public + (f" {comment}".encode() if comment else b"") + b"\n")
    return directory / "node.key", directory / "node.pub"


@dataclass
class Credentials:
    """Where a deployment's credentials are (see :func:`create_credentials`)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca.key"

    @property
    def server_dir(self) -> Path:
        return self.root / "superlink"

    def node_dir(self, name: str) -> Path:
        return self.root / "supernodes" / name


def create_credentials(root: Path, node_names: Sequence[str], sans: Sequence[str] = DEFAULT_SANS,
                       days: int = 30) -> Credentials:
    """The files of a deployment, laid out as they are handed out to the machines::

        ca/ca.pem, ca/ca.key                  the CA (keep ca.key offline)
        superlink/ca.pem, server.pem, server.key      -> the server
        supernodes/<name>/ca.pem, node.key, node.pub  -> device <name> (node.pub also to the server admin)
    """
    creds = Credentials(root.resolve())
    ca_cert, ca_key = create_ca(creds.ca_cert.parent, days)
    create_server_certificate(creds.server_dir, ca_cert, ca_key, list(sans), days)
    shutil.copyfile(ca_cert, creds.server_dir / "ca.pem")
    for name in node_names:
        add_node(creds, name)
    return creds


def add_node(creds: Credentials, name: str) -> Path:
    """Key pair and CA certificate for one more SuperNode; returns its folder."""
    folder = creds.node_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    create_node_keys(folder, comment=name)
    shutil.copyfile(creds.ca_cert, folder / "ca.pem")
    return folder


# --------------------------------------------------------------------------- node configs

_SUFFIX = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_capability(spec: str) -> dict[str, float]:
    """``level=0.5`` -> ``{"capability-level": 0.5}``; ``memory=64M`` -> bytes; ``-`` -> nothing."""
    spec = spec.strip()
    if spec in ("-", "", "none"):
        return {}
    kind, sep, raw = spec.partition("=")
    if not sep or kind not in CAPABILITY_KINDS:
        raise ValueError(f"capability {spec!r}: expected one of {', '.join(k + '=VALUE' for k in CAPABILITY_KINDS)} or '-'")
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
    return {f"capability-{kind}": value}


def node_config(partition_id: int, num_partitions: int, capability: dict[str, float] | None = None,
                data_dir: str | None = None) -> dict[str, Any]:
    """The node config of one SuperNode (what ``clients/base.py`` reads)."""
    config: dict[str, Any] = {"partition-id": int(partition_id), "num-partitions": int(num_partitions)}
    if data_dir:
        config["data-dir"] = str(data_dir)
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

    def __init__(self, work_dir: Path, port: int | None = None, tag: str | None = None,
                 say: Callable[[str], None] = _say, keep_fds: Sequence[int] = ()) -> None:
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

    # -- plumbing

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, flwr_home: Path) -> dict[str, str]:
        env = dict(os.environ)
        # Flower starts flower-superexec, flwr-serverapp and flwr-clientapp by name: find this
        # environment's, also when it is not activated (make calls .venv/bin/python directly)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.update({
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            TAG_VAR: self.tag,
        })
        return env

    def flwr(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        """Run a ``flwr`` CLI command with ``--format json`` against this SuperLink; its JSON answer."""
        cmd = [_bin("flwr"), *args, CONNECTION, "--format", "json"]
        out = subprocess.run(cmd, env=self.env(self.cli_home), cwd=APP_DIR, capture_output=True, text=True,
                             timeout=timeout, start_new_session=True)
        text = out.stdout
        try:
            answer = json.loads(text[text.index("{"):])
        except ValueError:
            answer = {}
        if out.returncode != 0 or not answer.get("success", False):
            raise RuntimeError(f"`{' '.join(cmd[1:])}` failed (exit {out.returncode}): "
                               f"{(out.stdout + out.stderr).strip()[-1500:]}")
        return answer

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.logs / f"{name}.log"
        if not path.is_file():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- steps

    def make_credentials(self, node_names: Sequence[str], sans: Sequence[str] = DEFAULT_SANS) -> Credentials:
        self.creds = create_credentials(self.work_dir, node_names, sans)
        self.say(f"credentials in {self.work_dir} (CA, SuperLink certificate, {len(node_names)} SuperNode key pairs)")
        return self.creds

    def start_superlink(self, timeout: float = 90) -> None:
        server = self.creds.server_dir
        home = server / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{self.address}"\n'
            f"root-certificates = {toml_string(str(server / 'ca.pem'))}\n"
        )
        cmd = [_bin("flower-superlink"),
               "--ssl-ca-certfile", str(server / "ca.pem"),
               "--ssl-certfile", str(server / "server.pem"),
               "--ssl-keyfile", str(server / "server.key"),
               "--enable-supernode-auth",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--database", str(server / "state.db"),
               "--disable-runtime-dependency-installation"]
        proc = self.processes.start("superlink", cmd, self.env(home), self.logs / "superlink.log", cwd=server)
        context = ssl.create_default_context(cafile=str(server / "ca.pem"))  # also checks the certificate
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with {proc.returncode}:\n{self.log_tail('superlink')}")
            try:
                with urllib.request.urlopen(f"https://{self.address}/health", timeout=2, context=context) as r:
                    if r.status == 200:
                        self.say(f"SuperLink up at https://{self.address} (TLS, SuperNode authentication on)")
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"flower-superlink not ready in {timeout:.0f} s:\n{self.log_tail('superlink')}")

    def register(self, name: str) -> int:
        """Register a SuperNode's public key with the SuperLink; its node id."""
        answer = self.flwr("supernode", "register", str(self.creds.node_dir(name) / "node.pub"), "--name", name)
        self.node_ids[name] = int(answer["node-id"])
        return self.node_ids[name]

    def nodes(self) -> list[dict[str, Any]]:
        """``flwr supernode ls``: every registered SuperNode with its status."""
        return list(self.flwr("supernode", "ls").get("nodes", []))

    def start_supernode(self, name: str, config: dict[str, Any], *, with_ca: bool = True,
                        max_retries: int | None = None, max_wait_time: float | None = None,
                        extra_env: dict[str, str] | None = None,
                        restart_wait: float | None = None) -> subprocess.Popen[bytes]:
        """Start SuperNode ``name`` with its key, the CA certificate (unless ``with_ca=False``) and ``config``
        (``extra_env``: variables of the device's own environment, e.g. where its other data would be),
        as a device does: through ``fedhm supernode`` (:mod:`fedhm_flwr.supernode`), which starts it
        again once if the SuperLink still holds the session of a killed predecessor (``restart_wait``:
        its wait, default the heartbeat window plus a margin; 0: no second start)."""
        folder = self.creds.node_dir(name)
        home = folder / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        (folder / "node-config.toml").write_text(node_config_toml(config))
        wrapper = [sys.executable, "-m", "fedhm_flwr.supernode"]
        if restart_wait is not None:
            wrapper += ["--restart-wait", str(restart_wait)]
        cmd = [*wrapper, "--superlink", self.address,
               "--auth-supernode-private-key", str(folder / "node.key"),
               "--node-config", str(folder / "node-config.toml"),
               "--host", "127.0.0.1", "--port", str(free_port())]
        if with_ca:
            cmd += ["--root-certificates", str(folder / "ca.pem")]
        if max_retries is not None:
            cmd += ["--max-retries", str(max_retries)]
        if max_wait_time is not None:
            cmd += ["--max-wait-time", str(max_wait_time)]
        env = {**self.env(home), **(extra_env or {})}
        # `python -m fedhm_flwr.supernode` of this checkout, also where another one is installed
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
                    raise RuntimeError(f"SuperNode {name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            online = {str(n["node-id"]) for n in self.nodes() if n.get("status") == "online"}
            if set(wanted) <= online:
                self.say(f"{len(names)} SuperNode(s) online: {', '.join(names)}")
                return
            if time.monotonic() > deadline:
                missing = sorted(wanted[i] for i in set(wanted) - online)
                raise RuntimeError(f"SuperNodes not online after {timeout:.0f} s: {missing}")
            time.sleep(2.0)

    def run_job(self, overrides: Sequence[str], run_dir: Path, timeout: float | None = None,
                echo: bool = True, resume: Path | None = None, commands: Commands | None = None) -> dict[str, Any]:
        """The staged app through ``flwr run <app> <connection> --stream`` (the launcher's runner:
        own run id, final status, summary); returns ``summary.json``."""
        run_dir = run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        run_config = write_run_config(self.cli_home / "run-config.toml", overrides, run_dir, resume)
        app = stage_app(self.work_dir / "app")  # the app's own files, not tests/ bench/ scripts/ docs/
        self.say(f"flwr run {app} {CONNECTION} --stream --run-config {run_config}  (outputs in {run_dir})")
        job = FlowerJob(self.processes, self.env(self.cli_home), CONNECTION, self.logs / "flwr-run.log", echo)
        return run_flower_job(job, app, run_config, run_dir, timeout=timeout, see=f" and {self.logs}/superlink.log",
                              commands=commands)

    def close(self) -> None:
        """Stop every process this deployment started (SuperNodes, then the SuperLink, then stragglers)."""
        self.leftovers = self.processes.close(grace=10.0, settle=3.0)
        if self.leftovers:
            self.say(f"stopped {len(self.leftovers)} process(es) that had left their group: {self.leftovers}")
        remaining = [p for p in tagged_pids(self.tag) if _alive(p)]
        if remaining:
            self.say(f"WARNING: processes still running: {remaining}")

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- command line


def deploy(num_nodes: int, overrides: Sequence[str], capabilities: Sequence[str] | None = None,
           data_dir: str | None = None, run_dir: Path | None = None, port: int | None = None,
           sans: Sequence[str] = DEFAULT_SANS, timeout: float | None = None, resume: Path | None = None,
           command: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole sequence of the module docstring; returns the run's summary.

    ``resume``: continue the run stored in that run directory. ``command``: how this deployment
    was started, without overrides (printed with ``--resume`` when the run is interrupted)."""
    overrides = list(overrides)
    if resume is None and not any(o.lstrip("+~").split("=", 1)[0] == "num_clients" for o in overrides):
        overrides.insert(0, f"num_clients={num_nodes}")  # the config records the real federation size
    # a bad value or missing data stops here, before anything starts
    if resume is not None:
        require_checkpoint(resume.resolve())  # a resume without a checkpoint is refused at once, naming the folder
    cfg = resume_config(resume, overrides) if resume is not None else load_config(overrides)
    check_data(cfg, simulation=False)  # each node checks its own shard when it first answers
    levels = [float(x) for x in cfg.levels.ratios]
    specs = list(capabilities) if capabilities else [f"level={levels[i % len(levels)]:g}" for i in range(num_nodes)]
    caps = [parse_capability(specs[i % len(specs)]) for i in range(num_nodes)]
    run_dir = (resume or run_dir or default_run_dir(f"{cfg.method.name}-deploy")).resolve()
    command = list(command or [sys.executable, str(Path(__file__).resolve()), "--nodes", str(num_nodes)])
    commands = Commands((*command, "--resume"), tuple(command), APP_DIR)
    names = [f"node-{i}" for i in range(num_nodes)]
    tag = new_tag()
    with on_signals():
        try:
            with RunLock(run_dir, tag) as lock:  # a second deployment into a live run's directory is refused
                if resume is None:
                    refuse_existing_run(run_dir)
                else:
                    require_checkpoint(run_dir)
                with LocalDeployment(run_dir / "deploy", port=port, tag=tag, keep_fds=[lock.fd]) as dep:
                    dep.make_credentials(names, sans)
                    dep.start_superlink()
                    for name in names:
                        dep.say(f"registered {name} (node id {dep.register(name)})")
                    for i, name in enumerate(names):
                        folder = data_dir.replace("{i}", str(i)) if data_dir else None
                        config = node_config(i, num_nodes, caps[i], folder)
                        dep.start_supernode(name, config)
                        dep.say(f"{name}: {' '.join(f'{k}={v}' for k, v in config.items())}")
                    dep.wait_online(names)
                    return dep.run_job(overrides, run_dir, timeout=timeout, resume=resume, commands=commands)
        except Interrupted as stop:  # everything is stopped: the report names the command that resumes the run
            raise interrupted(stop, run_dir, commands, overrides if resume is None else []) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/deploy_local.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job, e.g. rounds=3 model.width=16")
    parser.add_argument("--nodes", "-n", type=int, default=2, help="number of SuperNodes (default 2)")
    parser.add_argument("--capabilities", default="",
                        help='one capability spec per node, space separated, cycled: e.g. "level=1 params=2e4 macs=4e5 -"')
    parser.add_argument("--data-dir", help="node config data-dir of every node; {i} is replaced by the node index")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: outputs/<date>/<time>-<method>-deploy)")
    parser.add_argument("--port", type=int, help="SuperLink port (default: a free one)")
    parser.add_argument("--san", action="append", default=[],
                        help="extra name or IP address the SuperLink certificate is valid for (repeatable)")
    parser.add_argument("--timeout", type=float, help="give up on the job after this many seconds")
    parser.add_argument("--resume", type=Path, help="continue the run stored in this run directory")
    parser.add_argument("--days", type=int, default=30, help="validity of the certificates in days (default 30)")
    parser.add_argument("--credentials-only", type=Path, metavar="DIR",
                        help="only write the credentials of --nodes SuperNodes into DIR (for real machines) and exit")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    sans = list(args.san) + list(DEFAULT_SANS)  # the first name is also the certificate's common name
    if args.credentials_only:
        creds = create_credentials(args.credentials_only, [f"node-{i}" for i in range(args.nodes)], sans, args.days)
        _say(f"credentials written to {creds.root}: ca/ (keep ca.key offline), superlink/ (server), "
             f"supernodes/node-<i>/ (one folder per device)")
        return 0

    command = [sys.executable, str(Path(__file__).resolve()), "--nodes", str(args.nodes)]
    command += ["--capabilities", args.capabilities] if args.capabilities else []
    command += ["--data-dir", args.data_dir] if args.data_dir else []
    command += [item for san in args.san for item in ("--san", san)]
    try:
        capabilities = args.capabilities.split() if args.capabilities else None
        if capabilities:
            for spec in capabilities:
                parse_capability(spec)
        with on_signals():  # SIGINT / SIGTERM / SIGHUP from the start: a clean stop, exit 128 + the signal
            summary = deploy(args.nodes, split_overrides(args.overrides), capabilities, args.data_dir, args.run_dir,
                             args.port, sans, args.timeout, args.resume, command)
    except (ConfigError, ValueError, FileExistsError) as err:  # FileExistsError includes a locked run directory
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # RunInterrupted (everything stopped; the resume command) or before the start
        return report_stop(stop)
    acc = summary.get("final_acc/global")
    _say(f"run complete: final global accuracy {acc if acc is None else f'{acc:.4f}'}; "
         f"outputs in {summary['output_dir']}; everything started has been stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
