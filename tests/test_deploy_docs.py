"""docs/DEPLOY.md's walk-through, run as written on one machine (loopback only).

The commands come from the guide's own code blocks (so the guide cannot drift from what works);
the test only substitutes what a single machine needs instead of several: 127.0.0.1 and free
ports for the server's address and each SuperNode's Runtime API ``--port``, temporary folders for
``/data``, ``/srv``, ``/var/lib``, the staged app for ``flwr run .``, the run id for
``<run-id>``, and a tiny job for ``RUN``. Each machine's commands run in its own folder with its
own ``FLWR_HOME``: the server in ``creds/superlink/``, device i in ``creds/supernodes/node-<i>/``,
the operator in the folder holding ``creds/``. Then the "Stopping a device" commands: a SuperNode
killed with ``kill -9`` leaves children that the guide's ``pgrep`` lists and its ``kill <pid>``
ends; ``kill <pid>`` (SIGTERM) of ``fedhm supernode`` ends the node and its children.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from test_deploy import ROOT, needs_fmnist

from fedhm_flwr.ops.procs import Processes, alive, command_name, stat_field, tagged_pids
from fedhm_flwr.ops.superlink import flower_env, free_port, stage_app
from fedhm_flwr.ops.supernode import children

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
        "/var/lib/fedhm/state.db": str(tmp_path / "state.db"),
        "/data/fedhm-shards": str(tmp_path / "shards"),
        "/srv/fedhm/run1": str(tmp_path / "run1"),
        "flwr run . fedhm": f"flwr run {stage_app(tmp_path / 'app')} fedhm",
    }

    def local(block: str, **more: str) -> str:
        for old, new in {**where, **more}.items():
            block = block.replace(old, new)
        return block

    # the `fedhm` of this checkout, as a shell function (the environment's console script may be another's)
    fedhm = f"{sys.executable} -m fedhm_flwr"
    prelude = f'fedhm() {{ {fedhm} "$@"; }}\nRUN="{TINY}"\n'
    procs = Processes()
    tag = procs.tag

    def env(home: str) -> dict[str, str]:
        base = flower_env(tmp_path / home)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
        base["COLUMNS"] = "200"  # the flwr CLI's tables whole
        return procs.env(base)

    def bash(
        script: str, home: str = "operator", cwd: Path = tmp_path, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        (tmp_path / home).mkdir(exist_ok=True)
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", prelude + script],
            cwd=cwd,
            env=env(home),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def background(name: str, script: str, home: str, cwd: Path) -> subprocess.Popen[bytes]:
        (tmp_path / home).mkdir(exist_ok=True)
        command = " ".join(line.rstrip("\\") for line in script.strip().splitlines())
        command = "exec " + re.sub(r"^fedhm ", f"{fedhm} ", command)  # bash becomes the program
        return procs.start(name, ["bash", "-c", prelude + command], env(home), tmp_path / f"{name}.log", cwd=cwd)

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
        superlink = background("superlink", local(_only(walk, "flower-superlink")), "server", creds / "superlink")
        context = ssl.create_default_context(cafile=str(creds / "ca" / "ca.pem"))  # and the name 127.0.0.1 in its SANs
        deadline = time.monotonic() + 90
        while True:
            assert superlink.poll() is None and time.monotonic() < deadline, (tmp_path / "superlink.log").read_text()
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=2, context=context):
                    break
            except OSError:
                time.sleep(0.5)
        # 4. the operator's connection (the guide's config.toml) and the registrations
        (tmp_path / "operator").mkdir(exist_ok=True)
        (tmp_path / "operator" / "config.toml").write_text(
            local(connection, **{"/abs/path/to/ca.pem": str(creds / "ca" / "ca.pem")})
        )
        bash(local(_only(walk, "flwr supernode register")))
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
                f"device-{i}",
                creds / "supernodes" / f"node-{i}",
            )
        listing = _only(walk, "flwr supernode ls")
        deadline = time.monotonic() + 180
        while (online := bash(local(listing)).stdout.count("online")) < 3:
            assert all(p.poll() is None for p in nodes.values()), [
                (tmp_path / f"node-{i}.log").read_text()[-2000:] for i in nodes
            ]
            assert time.monotonic() < deadline, f"{online} devices online after 180 s"
            time.sleep(2)
        # 6. the run, its real final status, the ServerApp's own lines
        run_block = [line for line in _only(walk, "flwr run .").splitlines() if line.strip()]
        assert [line.split()[:2] for line in run_block] == [["flwr", "run"], ["flwr", "list"], ["flwr", "log"]]
        started = bash(local(run_block[0]), timeout=600)
        run_id = re.search(r"Successfully started run (\d+)", started.stdout + started.stderr).group(1)
        listed = bash(local(run_block[1])).stdout
        runs = {str(r["run-id"]): r for r in json.loads(listed[listed.index("{") :])["runs"]}
        assert runs[run_id]["status"] == "finished:completed", runs[run_id]
        lines = bash(local(run_block[2], **{"<run-id>": run_id})).stdout
        assert lines.count(" joined (node id") == 3 and "[round 1/1]" in lines, lines[-3000:]
        # 8. results on the server: status and a level's deployable model
        status, export_model = [line for line in _only(walk, "fedhm export").splitlines() if line.strip()]
        assert bash(local(status)).returncode == 0
        bash(local(export_model))
        assert list((tmp_path / "run1").glob("export*")) or list((tmp_path / "run1").rglob("*.safetensors"))
        # normalised with the deployment statistics the devices sent after the last round (over the wire:
        # tests/test_deployable.py checks such exports for batch independence after in-process runs)
        (card,) = (tmp_path / "run1").glob("export/*/model_card.json")
        assert json.loads(card.read_text())["normalisation"]["statistics"] == "federated", card.read_text()
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
    finally:
        procs.close(grace=10.0, settle=3.0)
        print(f"[test] walk-through test took {time.monotonic() - t0:.0f} s", flush=True)
    assert tagged_pids(tag) == []


def _until_gone(pids: list[int], timeout: float) -> None:
    end = time.monotonic() + timeout
    while [p for p in pids if alive(p)]:
        assert time.monotonic() < end, f"still running after {timeout:g} s: {[p for p in pids if alive(p)]}"
        time.sleep(0.2)


def _parent(pid: int) -> int | None:
    return stat_field(pid, 1)
