"""docs/DEPLOY.md's walk-through, run as written on one machine (loopback only), and its text's checks.

The commands come from the guide's own code blocks (so the guide cannot drift from what works);
the test only substitutes what a single machine needs instead of several: 127.0.0.1 and free
ports for the server's address and each SuperNode's Runtime API ``--port``, temporary folders for
``/data``, ``/srv``, ``/var/lib``, ``~``, the run id for ``<run-id>``, and a tiny job for ``RUN``.
Each machine's commands run in its own folder: the server in ``creds/superlink/``, device i in
``creds/supernodes/node-<i>/``, the operator in the folder holding ``creds/``; each role's
``FLWR_HOME`` is the one the guide sets (the environment's points at a stand-in for ``~/.flwr``
that must stay unused). The app the guide's ``fedhm stage`` stages is what the SuperLink and every
device install, without ``tests/``, ``docs/``, ``results/``. The guide's stop of a stopped run
exits 0 on both of Flower's answers (the run still running; already finished). Then the "Stopping
a device" commands: a SuperNode killed with ``kill -9`` leaves children that the guide's
``pgrep`` lists and its ``kill <pid>`` ends; ``kill <pid>`` (SIGTERM) of ``fedhm supernode`` ends
the node and its children.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import load_ssh_public_key
from test_deploy import FEDHM, ROOT, needs_fmnist

from fedhm_flwr.ops.deploy.supernode import children
from fedhm_flwr.ops.job.procs import Processes, alive, command_name, stat_field, tagged_pids
from fedhm_flwr.ops.job.superlink import flower_env, free_port

DOC = ROOT / "docs" / "DEPLOY.md"
#: the walk-through's job, made tiny: 3 devices, 1 round, a width-4 CNN on 600 examples, two levels (the full
#: model and the 0.25 that the guide exports: after the last round every level's deployment statistics are
#: one more query to every device, each a ClientApp process)
TINY = (
    "num_clients=3 rounds=1 evaluation.where=clients availability.min_nodes=3 availability.wait_seconds=120 "
    "dataset.max_train_examples=600 model.width=4 levels.ratios=[1,0.25] evaluation.levels=false timeout=120"
)


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _blocks(section: str, lang: str = "bash") -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(rf"^ *```{lang}\n(.*?)^ *```", section, flags=re.S | re.M)]


def _only(blocks: list[str], word: str) -> str:
    (block,) = [b for b in blocks if word in b]
    return block


def _lines(block: str) -> list[str]:
    """A block's commands, one per line (continuation lines joined)."""
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
@needs_fmnist
def test_deploy_md_walkthrough_runs_as_written_on_loopback(tmp_path):
    walk = _blocks(_section("From shard export to results: a walk-through"))
    stopping = _only(_blocks(_section("Stopping a device")), "pgrep")
    (connection,) = [b for b in _blocks(_section("The operator: connection, registration, runs"), "toml")]
    port = free_port()
    where = {
        "fl.example.org:8000": f"127.0.0.1:{port}",
        "--host 0.0.0.0 --port 8000": f"--host 127.0.0.1 --port {port}",
        "/var/lib/fedhm": str(tmp_path / "var-lib-fedhm"),
        "~/fedhm-operator": str(tmp_path / "operator"),
        "/data/fedhm-shards": str(tmp_path / "shards"),
        "/srv/fedhm": str(tmp_path / "srv"),
    }
    (tmp_path / "var-lib-fedhm").mkdir()
    register = _only(walk, "flwr supernode register")
    # the operator's FLWR_HOME, as the guide sets it in step 4, for every command of the operator's shell
    (operator_home,) = [line for line in _lines(register) if line.startswith("export FLWR_HOME=")]

    def local(block: str, **more: str) -> str:
        for old, new in {**where, **more}.items():
            block = block.replace(old, new)
        return block

    # the `fedhm` of this checkout, as a shell function (the environment's console script may be another's)
    fedhm = f"{sys.executable} -m fedhm_flwr"
    prelude = f'fedhm() {{ {fedhm} "$@"; }}\nRUN="{TINY}"\n'
    procs = Processes()
    tag = procs.tag

    default_home = tmp_path / "default-home"  # ~/.flwr for every role that the guide gives no FLWR_HOME

    def env() -> dict[str, str]:
        base = flower_env(default_home)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
        base["COLUMNS"] = "200"  # the flwr CLI's tables whole
        return procs.env(base)

    def bash(
        script: str, cwd: Path = tmp_path, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:  # the operator's shell
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", prelude + local(operator_home) + "\n" + script],
            cwd=cwd,
            env=env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def background(name: str, script: str, cwd: Path) -> subprocess.Popen[bytes]:
        *before, command = _lines(script)  # e.g. the export of the role's FLWR_HOME, then its program
        command = "exec " + re.sub(r"^fedhm ", f"{fedhm} ", command)  # bash becomes the program
        return procs.start(
            name, ["bash", "-c", prelude + "\n".join([*before, command])], env(), tmp_path / f"{name}.log", cwd=cwd
        )

    t0 = time.monotonic()
    try:
        # 1. the shards (RUN is the guide's variable, made tiny by the prelude; the guide's own line is dropped)
        export = _only(walk, "out=/data/fedhm-shards")
        assert export.startswith("RUN=")
        bash(local(export.split("\n", 1)[1]))
        for i in range(3):
            assert (tmp_path / "shards" / f"partition-{i}" / "manifest.json").is_file()
        # 2. credentials
        bash(local(_only(walk, "--credentials-only")))
        creds = tmp_path / "creds"
        # 3. the server, in its folder
        superlink = background("superlink", local(_only(walk, "flower-superlink")), creds / "superlink")
        context = ssl.create_default_context(cafile=str(creds / "ca" / "ca.pem"))  # and the name 127.0.0.1 in its SANs
        deadline = time.monotonic() + 90
        while True:
            assert superlink.poll() is None and time.monotonic() < deadline, (tmp_path / "superlink.log").read_text()
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=2, context=context):
                    break
            except OSError:
                time.sleep(0.5)
        # 4. the operator's connection (the guide's config.toml, in its FLWR_HOME) and the registrations: each
        # prints its node ID, the --name is kept with the key in the SuperLink's database
        (tmp_path / "operator").mkdir(exist_ok=True)
        (tmp_path / "operator" / "config.toml").write_text(
            local(connection, **{"/abs/path/to/ca.pem": str(creds / "ca" / "ca.pem")})
        )
        registered = bash(local(register)).stdout
        assert len(re.findall(r"SuperNode -?\d+ registered successfully", registered)) == 4, registered
        with sqlite3.connect(tmp_path / "var-lib-fedhm" / "state.db") as db:
            assert sorted(n for (n,) in db.execute("SELECT name FROM node")) == [f"ward-{i}" for i in range(4)]
        # 5. devices 0-2, each in its folder, each with its own Runtime API port
        device = _only(walk, "fedhm supernode")
        ports: set[int] = set()
        nodes = {}
        for i in range(3):
            while (runtime := free_port()) in ports:
                pass
            ports.add(runtime)
            nodes[i] = background(
                f"node-{i}",
                local(
                    device,
                    **{
                        "<i>": str(i),
                        "/data/fedhm/partition-": str(tmp_path / "shards" / "partition-"),
                        "--port 9094": f"--port {runtime}",
                    },
                ),
                creds / "supernodes" / f"node-{i}",
            )
        listing = _only(walk, "flwr supernode list")
        deadline = time.monotonic() + 180
        while (online := bash(local(listing)).stdout.count("online")) < 3:
            assert all(p.poll() is None for p in nodes.values()), [
                (tmp_path / f"node-{i}.log").read_text()[-2000:] for i in nodes
            ]
            assert time.monotonic() < deadline, f"{online} devices online after 180 s"
            time.sleep(2)
        # 6. the app staged alone, the run, its real final status, the ServerApp's own lines
        run_block = _lines(_only(walk, "fedhm stage"))
        assert [line.split()[:2] for line in run_block] == [
            ["fedhm", "stage"],
            ["flwr", "run"],
            ["flwr", "list"],
            ["flwr", "log"],
        ]
        app = Path(bash(local(run_block[0])).stdout.strip())
        assert app == tmp_path / "srv" / "app" and run_block[1].startswith("flwr run /srv/fedhm/app fedhm")
        started = bash(local(run_block[1]), timeout=600)
        run_id = re.search(r"Successfully started run (\d+)", started.stdout + started.stderr).group(1)
        listed = bash(local(run_block[2])).stdout
        runs = {str(r["run-id"]): r for r in json.loads(listed[listed.index("{") :])["runs"]}
        assert runs[run_id]["status"] == "finished:completed", runs[run_id]
        lines = bash(local(run_block[3], **{"<run-id>": run_id})).stdout
        assert lines.count(" joined (node id") == 3 and "[round 1/1]" in lines, lines[-3000:]
        # 8. results on the server: status and a level's deployable model
        status, export_model = [line for line in _only(walk, "fedhm export").splitlines() if line.strip()]
        assert bash(local(status)).returncode == 0
        bash(local(export_model))
        run1 = tmp_path / "srv" / "run1"  # /srv/fedhm/run1
        assert list(run1.glob("export*")) or list(run1.rglob("*.safetensors"))
        # normalised with the deployment statistics the devices sent after the last round (over the wire:
        # tests/test_deployable.py checks such exports for batch independence after in-process runs)
        (card,) = run1.glob("export/*/model_card.json")
        assert json.loads(card.read_text())["normalisation"]["statistics"] == "federated", card.read_text()
        # what shipped: the staged app, installed in each role's own FLWR_HOME, none of it in ~/.flwr
        var_lib = tmp_path / "var-lib-fedhm"  # /var/lib/fedhm
        for home in [var_lib / "flwr-home", *(var_lib / f"ward-{i}" for i in range(3))]:
            (installed,) = (home / "apps").glob("fedhm.fedhm-flwr.*")
            shipped = {f for f in _files(installed) if not f.startswith(".info/")}
            assert {"pyproject.toml", "conf/config.yaml", "fedhm_flwr/ops/apps/client_app.py"} <= shipped <= _files(app)
            assert not {f.split("/")[0] for f in shipped} & {"tests", "docs", "results", "bench", "scripts"}, home
        # 9. the stopped run's stop, as written, on a run Flower has ended: Flower's refusal, then its status; exit 0
        stop_block = _lines(_only(walk, "flwr stop <run-id> fedhm ||"))
        assert [line.split()[:3] for line in stop_block] == [
            ["fedhm", "status", "/srv/fedhm/run1"],
            ["flwr", "stop", "<run-id>"],
            ["flwr", "run", "/srv/fedhm/app"],
        ]
        resume = stop_block[2]
        assert resume.startswith(run_block[1].split(" --run-config")[0]) and "resume='/srv/fedhm/run1'" in resume
        ended = bash(local(stop_block[1], **{"<run-id>": run_id}))
        assert "[code: 18] Run is already finished" in ended.stderr and "finished:completed" in ended.stdout, ended
        print(f"[test] walk-through to results in {time.monotonic() - t0:.0f} s", flush=True)

        # stopping a device: kill -9 of a SuperNode's PID leaves its children; the guide's pgrep lists them
        kill_line, pgrep_line = [line for line in stopping.splitlines() if line.strip()]
        assert kill_line.startswith("kill <pid>") and pgrep_line.startswith("pgrep")
        wrapper = nodes[1].pid  # bash exec'd `fedhm supernode`, whose child is flower-supernode
        (supernode,) = [p for p in tagged_pids(tag) if command_name(p) == "flower-supernode" and _parent(p) == wrapper]
        left = children(supernode)
        assert left, "a running SuperNode has its flower-superexec"
        os.kill(supernode, signal.SIGKILL)
        listed = bash(pgrep_line, check=False).stdout
        assert all(str(p) in listed for p in left if alive(p)), listed
        t_kill = time.monotonic()
        while any(alive(p) for p in left) and time.monotonic() - t_kill < 20:
            time.sleep(0.2)
        survivors = [p for p in left if alive(p)]
        print(
            f"[test] after kill -9: {len(left)} child(ren) of the SuperNode; "
            + (
                f"{len(survivors)} still running after 20 s"
                if survivors
                else f"gone by themselves after {time.monotonic() - t_kill:.1f} s"
            ),
            flush=True,
        )
        for pid in survivors:
            bash(kill_line.replace("<pid>", str(pid)), check=False)
        _until_gone(left, 15)
        # kill <pid> (SIGTERM) of `fedhm supernode`: the node and its children end
        own = [p for p in tagged_pids(tag) if command_name(p) == "flower-supernode" and _parent(p) == nodes[0].pid]
        kids = [c for p in own for c in children(p)]
        t_term = time.monotonic()
        bash(kill_line.replace("<pid>", str(nodes[0].pid)))
        nodes[0].wait(timeout=30)
        _until_gone([*own, *kids], 15)
        print(
            f"[test] kill <pid> of `fedhm supernode`: the node and its {len(kids)} child(ren) gone in "
            f"{time.monotonic() - t_term:.1f} s",
            flush=True,
        )
        # 9. the same stop on a run still running (started without --stream): Flower stops it; exit 0
        again = bash(f"flwr run {app} fedhm --run-config \"overrides='$RUN' output-dir='{tmp_path / 'run2'}'\"")
        second = re.search(r"Successfully started run (\d+)", again.stdout + again.stderr).group(1)
        stopped = bash(local(stop_block[1], **{"<run-id>": second}))
        assert f"Run {second} successfully stopped" in stopped.stdout and "[code:" not in stopped.stderr, stopped
    finally:
        procs.close(grace=10.0, settle=3.0)
        print(f"[test] walk-through test took {time.monotonic() - t0:.0f} s", flush=True)
    assert tagged_pids(tag) == []
    assert not (default_home / "apps").exists() and not (default_home / "config.toml").exists()


def _until_gone(pids: list[int], timeout: float) -> None:
    end = time.monotonic() + timeout
    while [p for p in pids if alive(p)]:
        assert time.monotonic() < end, f"still running after {timeout:g} s: {[p for p in pids if alive(p)]}"
        time.sleep(0.2)


def _parent(pid: int) -> int | None:
    return stat_field(pid, 1)


def _deploy_md_blocks() -> list[str]:
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_deploy_md_credential_commands_write_the_files_it_names(tmp_path):
    """DEPLOY.md's credential commands, run as written (in a scratch folder): the files its table and
    its register commands name are the ones written, and the certificate chain holds."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    (manual,) = [b for b in _deploy_md_blocks() if "ssh-keygen" in b]
    if shutil.which("openssl") and shutil.which("ssh-keygen"):
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", manual], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        for name in ("ca.pem", "ca.key", "server.pem", "server.key", "node.key", "node.key.pub"):
            assert (tmp_path / name).is_file(), name
        assert not (tmp_path / "node.pub").exists()  # ssh-keygen's public key is node.key.pub, as the docs say
        assert "`node.key.pub`" in text
        verify = subprocess.run(
            ["openssl", "verify", "-CAfile", "ca.pem", "server.pem"], cwd=tmp_path, capture_output=True, text=True
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
        load_ssh_public_key((tmp_path / "node.key.pub").read_bytes())  # what `flwr supernode register` reads
    line = next(ln for b in _deploy_md_blocks() for ln in b.splitlines() if "--credentials-only" in ln)
    args = line.split("#")[0].split()
    assert args[:2] == ["fedhm", "deploy-local"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([*FEDHM, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    creds = tmp_path / args[args.index("--credentials-only") + 1]
    for path in re.findall(r"^\| `((?:ca|superlink|supernodes)/[^`]+)`", text, flags=re.M):
        assert (creds / path.replace("<i>", "0")).is_file(), path
    # the register commands name a file that exists there (paths from the credentials folder or its parent)
    registered = [p.replace("<i>", "0").replace("$i", "0") for p in re.findall(r"flwr supernode register (\S+)", text)]
    assert registered and all((creds / path).is_file() or (tmp_path / path).is_file() for path in registered), (
        registered
    )


def test_deploy_md_says_where_the_serverapp_lines_are_and_gives_each_local_supernode_a_port():
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert "flwr log <run-id> fedhm" in text and "## Stopping a device" in text
    assert "SIGKILL" in text and "flower-superexec" in text and "flwr-clientapp" in text
    # the exit 1 / code 2004 row is not blamed on an unregistered key only
    assert len([ln for ln in text.splitlines() if "[code: 2004]" in ln and ln.startswith("|")]) == 2
    assert "own `--port`" in text
