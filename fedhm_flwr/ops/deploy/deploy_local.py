"""A real Flower deployment of fedhm-flwr on this machine: TLS, SuperNode authentication, N SuperNodes.

``fedhm deploy-local --nodes N [--capabilities "SPEC ..."] [HYDRA OVERRIDES ...]``
(what ``make deploy-local N=... CAPS="..." ARGS="..."`` calls; also ``python -m fedhm_flwr.ops.deploy.deploy_local``)
does what an operator does for a federation of real devices, with every machine replaced by a
process on the loopback interface (:class:`fedhm_flwr.ops.deploy.loopback.LocalDeployment`):

0. **checks**, before anything starts: the config, the server's test set and, without ``--data-dir``
   (the nodes cut their partitions from this machine's copy), data of at least 2 classes and a partition
   for every node, computed as the nodes compute it (as ``fedhm run``); one ``error:`` line, exit 2;
1. **credentials** (``<work>/ca``, ``<work>/superlink``, ``<work>/supernodes/node-<i>``,
   :mod:`fedhm_flwr.ops.deploy.credentials`): a certificate authority, a TLS certificate for the
   SuperLink signed by it (valid for ``localhost``, ``127.0.0.1``, ``::1`` and every ``--san``), and
   one EC P-384 key pair per SuperNode in OpenSSH format (what ``flower-supernode --auth-supernode-private-key`` and
   ``flwr supernode register`` read). Written with the ``cryptography`` package (a dependency of
   Flower), because one library makes both the X.509 certificates and the OpenSSH keys, which
   ``openssl`` alone cannot write; docs/DEPLOY.md gives the equivalent ``openssl`` /
   ``ssh-keygen`` commands for real machines;
2. **SuperLink**: ``flower-superlink`` (started as the launcher starts its own:
   :func:`fedhm_flwr.ops.job.superlink.start_superlink`, under ``fedhm superlink``'s guard) with ``--ssl-*`` (TLS) and
   ``--enable-supernode-auth`` (only SuperNodes whose public key was registered may connect), on one free loopback port
   that serves the Fleet, Control and Runtime APIs; runtime dependency installation disabled;
3. **registration**: ``flwr supernode register node-<i>/node.pub <connection>`` per SuperNode;
4. **SuperNodes**: ``flower-supernode --root-certificates ca.pem --auth-supernode-private-key
   node.key --node-config node-config.toml``, each with its own ``FLWR_HOME``, its own Runtime
   API port and a node config with ``partition-id``, ``num-partitions``, optionally ``data-dir``
   and a declared capability (``capability-level`` or a ``capability-params`` /
   ``capability-macs`` / ``capability-memory`` budget);
5. **the job**: the launcher's runner (:func:`fedhm_flwr.ops.job.flower_job.run_flower_job`): the
   staged app (only the app's own files) through ``flwr run <app> <connection> --stream`` with the Hydra
   overrides, judged by its own run id's final status (``--stream`` exits 0 even when a run
   fails) and its ``summary.json``; ``--resume <run dir>`` continues a stopped run;
6. **cleanup**: every process started here is stopped, also on failure, Ctrl-C or SIGTERM (the
   ServerApp first, then ``flwr stop <run id>``, the SuperNodes, the SuperLink; exit 130 / 143
   and the command that resumes the run): each runs in its own session and carries a unique
   tag in its environment, which its children inherit (``fedhm_flwr.ops.job.procs``); a watchdog stops
   them all if this command is killed outright. The run directory is locked while in use.

Capability specs (``--capabilities``, one per node, cycled when fewer than N):
``level=0.5``, ``params=20000``, ``macs=4e5``, ``memory=6.5e6`` (bytes; k/M/G suffixes are
accepted: ``memory=64M``), or ``-`` (declare nothing: the node gets ``levels.default``, else
the configured assignment). Default: node i declares ``level=<levels.ratios[i mod L]>``.

Everything lands in the run directory: ``summary.json`` and ``metrics.jsonl`` of the run, and
``deploy/`` with the credentials, node configs and the logs of every process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from fedhm_flwr.config import ConfigError, load_config, resume_config, run_options, split_overrides
from fedhm_flwr.ops.deploy.credentials import DEFAULT_SANS, create_credentials
from fedhm_flwr.ops.deploy.device_run import note_command
from fedhm_flwr.ops.deploy.loopback import LocalDeployment, node_config, parse_capability, say
from fedhm_flwr.ops.job.launch import check_data, check_training_data, default_run_dir
from fedhm_flwr.ops.job.outcome import (
    Commands,
    fedhm_program,
    interrupted,
    report_finished,
    require_checkpoint,
    run_command,
)
from fedhm_flwr.ops.job.procs import new_tag
from fedhm_flwr.ops.job.runlock import RunLock
from fedhm_flwr.ops.job.signals import Interrupted, on_signals
from fedhm_flwr.reporting.results import refuse_existing_run


def deploy(
    num_nodes: int,
    overrides: Sequence[str],
    capabilities: Sequence[str] | None = None,
    data_dir: str | None = None,
    run_dir: Path | None = None,
    port: int | None = None,
    sans: Sequence[str] = DEFAULT_SANS,
    timeout: float | None = None,
    resume: Path | None = None,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
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
    if data_dir is None:  # the nodes cut their partitions from this machine's copy, as `fedhm run`'s nodes do
        check_training_data(cfg)  # at least 2 classes, a partition for every node (computed as they do)
    opts = run_options(cfg)
    levels = list(opts.levels.ratios)
    specs = list(capabilities) if capabilities else [f"level={levels[i % len(levels)]:g}" for i in range(num_nodes)]
    caps = [parse_capability(specs[i % len(specs)]) for i in range(num_nodes)]
    run_dir = (resume or run_dir or default_run_dir(f"{opts.method.name}-deploy")).resolve()
    command = list(command or [*fedhm_program(), "deploy-local", "--nodes", str(num_nodes)])
    commands = Commands((*command, "--resume"), tuple(command))
    names = [f"node-{i}" for i in range(num_nodes)]
    tag = new_tag()
    with on_signals():
        try:
            with RunLock(run_dir, tag) as lock:  # a second deployment into a live run's directory is refused
                if resume is None:
                    refuse_existing_run(run_dir)
                else:
                    require_checkpoint(run_dir)
                note_command(run_dir, (*commands.resume, str(run_dir)))  # `fedhm resume` refuses it, naming this
                # (the lock is held: its descriptor is open)
                with LocalDeployment(run_dir / "deploy", port=port, tag=tag, keep_fds=[cast(int, lock.fd)]) as dep:
                    try:
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
                    except RuntimeError as err:  # a process that died is named, with its exit and its last lines
                        explained = dep.explain(err)
                        if explained is err:
                            raise
                        raise explained from None
        except Interrupted as stop:  # everything is stopped: the report names the command that resumes the run
            raise interrupted(stop, run_dir, commands, overrides if resume is None else []) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedhm deploy-local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job, e.g. rounds=3 model.width=16")
    parser.add_argument("--nodes", "-n", type=int, default=2, help="number of SuperNodes (default 2)")
    parser.add_argument(
        "--capabilities",
        default="",
        help='one capability spec per node, space separated, cycled: e.g. "level=1 params=2e4 macs=4e5 -"',
    )
    parser.add_argument("--data-dir", help="node config data-dir of every node; {i} is replaced by the node index")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: outputs/<date>/<time>-<method>-deploy)")
    parser.add_argument("--port", type=int, help="SuperLink port (default: a free one)")
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        help="extra name or IP address the SuperLink certificate is valid for (repeatable)",
    )
    parser.add_argument("--timeout", type=float, help="give up on the job after this many seconds")
    parser.add_argument("--resume", type=Path, help="continue the run stored in this run directory")
    parser.add_argument("--days", type=int, default=30, help="validity of the certificates in days (default 30)")
    parser.add_argument(
        "--credentials-only",
        type=Path,
        metavar="DIR",
        help="only write the credentials of --nodes SuperNodes into DIR (for real machines) and exit",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    sans = list(args.san) + list(DEFAULT_SANS)  # the first name is also the certificate's common name
    if args.credentials_only:
        creds = create_credentials(args.credentials_only, [f"node-{i}" for i in range(args.nodes)], sans, args.days)
        say(
            f"credentials written to {creds.root}: ca/ (keep ca.key offline), superlink/ (server), "
            f"supernodes/node-<i>/ (one folder per device)"
        )
        return 0

    command = [*fedhm_program(), "deploy-local", "--nodes", str(args.nodes)]
    command += ["--capabilities", args.capabilities] if args.capabilities else []
    command += ["--data-dir", args.data_dir] if args.data_dir else []
    command += [item for san in args.san for item in ("--san", san)]
    capabilities = args.capabilities.split() if args.capabilities else None

    def job() -> dict[str, Any]:
        for spec in capabilities or ():
            parse_capability(spec)  # a bad capability is refused before anything starts
        return deploy(
            args.nodes,
            split_overrides(args.overrides),
            capabilities,
            args.data_dir,
            args.run_dir,
            args.port,
            sans,
            args.timeout,
            args.resume,
            command,
        )

    code, summary = run_command(job, refused=(ConfigError, ValueError, FileExistsError))
    if summary is None:
        return code
    return report_finished(summary, "[deploy-local] ", "; everything started has been stopped")


if __name__ == "__main__":
    sys.exit(main())
