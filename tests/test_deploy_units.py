"""The systemd units and the ``openssl`` recipe of docs/DEPLOY.md.

Fast: every option a unit gives exists in the installed ``fedhm supernode`` / ``fedhm superlink`` and
Flower's programs. Slow: each unit's ``ExecStart`` run under the unit's own environment (``env -i`` with
only its ``Environment=`` lines, plus the test's process tag; systemd is not on these machines), on
loopback, with the server certificate the doc's ``openssl`` recipe makes, run as written: the SuperLink
serves over TLS, the device connects, a tiny run on it completes, and ``fedhm resume`` of that device run
refuses with the command that resumes it on the devices. What is replaced: ``/opt/fedhm/.venv`` by this
virtualenv, ``/etc/fedhm`` and ``/var/lib/fedhm`` by temporary folders, the address by 127.0.0.1 and a free
port; ``User=`` is not applied.
"""

from __future__ import annotations

import json
import re
import shlex
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_deploy import FEDHM, ROOT, needs_fmnist

from fedhm_flwr.ops import cli
from fedhm_flwr.ops.deploy import device_run, link_guard, supernode as sn
from fedhm_flwr.ops.job.procs import Processes, tagged_pids
from fedhm_flwr.ops.job.superlink import free_port

DOC = ROOT / "docs" / "DEPLOY.md"


def _unit_blocks() -> dict[str, str]:
    """Each ```ini unit of the doc, by the wrapper its ExecStart runs (``supernode``, ``superlink``)."""
    blocks = {}
    for block in re.findall(r"```ini\n(.*?)```", DOC.read_text(), flags=re.S):
        blocks[_exec_start(block)[1]] = block
    return blocks


def _exec_start(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)  # systemd's line continuation
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", joined, flags=re.M)
    return shlex.split(exec_start)


def _environment(block: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in re.findall(r"^Environment=(.+)$", block, flags=re.M))


def _options(help_text: str) -> dict[str, bool]:
    """The options an argparse help lists: {option: whether it takes a value}."""
    found = {}
    for name, value in re.findall(r"^\s+(?:-\w+(?: \S+)?, )?(--[a-z][a-z0-9-]*)( [A-Z{\[]|=)?", help_text, flags=re.M):
        found[name] = bool(value)
    return found


def _check(argv: list[str], options: dict[str, bool]) -> None:
    """Every option is known and gets a value exactly when it takes one; no stray argument."""
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        assert name in options, f"unknown option {argv[i]!r} in {argv}"
        if options[name] and not eq:
            assert i + 1 < len(argv) and not argv[i + 1].startswith("--"), f"{name} needs a value: {argv}"
            i += 1
        i += 1


def test_the_systemd_units_in_deploy_md_run_real_commands_with_real_options(capsys):
    units = _unit_blocks()
    assert set(units) == {"supernode", "superlink"}
    for block in units.values():
        argv, env = _exec_start(block), _environment(block)
        assert Path(argv[0]).name == "fedhm" and "Restart=on-failure" in block and "[Install]" in block
        assert "KillMode=mixed" in block  # the wrapper stops its Flower process (and what that started) itself
        # Flower starts its helpers by name: the virtualenv's bin/ first on the unit's PATH
        assert env["PATH"].split(":")[0] == str(Path(argv[0]).parent), env
    device, server = _exec_start(units["supernode"]), _exec_start(units["superlink"])
    for main in (sn.main, link_guard.main):
        with pytest.raises(SystemExit):
            main(["--help"])
    wrappers = _options(capsys.readouterr().out)
    bin_dir = Path(sys.executable).parent

    def help_of(program: str) -> dict[str, bool]:
        done = subprocess.run([str(bin_dir / program), "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return _options(done.stdout)

    flower_supernode, flower_superlink = help_of("flower-supernode"), help_of("flower-superlink")
    # the parse of the help can fail: these are known to take a value, these not
    assert wrappers["--restart-wait"] and wrappers["--connect-timeout"] and wrappers["--helper-wait"]
    assert flower_supernode["--superlink"] and flower_supernode["--node-config"]
    assert not flower_supernode["--insecure"] and not flower_superlink["--enable-supernode-auth"]
    _check(device[2:], {**flower_supernode, **wrappers})
    _check(server[2:], {**flower_superlink, **wrappers})
    with pytest.raises(AssertionError):
        _check(["--superlink"], flower_supernode)
    with pytest.raises(AssertionError):
        _check(["--root-certificate", "ca.pem"], flower_supernode)


# --------------------------------------------------------------------------- the units, run


JOB = (
    "num_clients=1 rounds=1 fraction_train=1.0 min_train_nodes=1 availability.min_nodes=1 "
    "dataset.max_train_examples=300 dataset.max_test_examples=200 model.width=4 levels.ratios=[1,0.25] "
    "evaluation.levels=false evaluation.deploy_stats=false timeout=180"
)


@pytest.mark.slow
@needs_fmnist
def test_the_units_serve_connect_and_run_under_their_own_environment_with_the_openssl_certificate(tmp_path):
    server_etc, device_etc, var, operator = (tmp_path / n for n in ("etc-server", "etc-device", "var", "operator"))
    for folder in (server_etc, device_etc, var, operator):
        folder.mkdir()
    # the doc's openssl recipe, as written, in the server's /etc/fedhm
    (recipe,) = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S) if "ssh-keygen" in b]
    made = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=server_etc, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    for name in ("ca.pem", "node.key"):  # the device's /etc/fedhm: the CA certificate, its key, its node config
        (device_etc / name).write_bytes((server_etc / name).read_bytes())
    (device_etc / "node-config.toml").write_text("partition-id = 0\nnum-partitions = 1\n")
    port = free_port()
    local = {
        "/opt/fedhm/.venv": sys.prefix,
        "/var/lib/fedhm": str(var),
        "0.0.0.0": "127.0.0.1",
        "fl.example.org:8000": f"127.0.0.1:{port}",
    }
    procs = Processes()

    def start(unit: str, etc: Path) -> subprocess.Popen[bytes]:
        block = _unit_blocks()[unit]
        for old, new in {**local, "/etc/fedhm": str(etc)}.items():
            block = block.replace(old, new)
        argv = [a if a != "8000" else str(port) for a in _exec_start(block)]
        workdir = Path(re.search(r"^WorkingDirectory=(.+)$", block, flags=re.M).group(1))
        env = procs.env(_environment(block))  # env -i: the unit's Environment= lines (and the test's tag)
        return procs.start(unit, argv, env, tmp_path / f"{unit}.log", cwd=workdir)

    def log(unit: str) -> str:
        return (tmp_path / f"{unit}.log").read_text(errors="replace")

    cli_env = {**procs.env(), "FLWR_HOME": str(operator), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}

    def flwr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "flwr"), *args],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    try:
        superlink = start("superlink", server_etc)
        context = ssl.create_default_context(cafile=str(server_etc / "ca.pem"))  # 127.0.0.1 must be in its SANs
        deadline = time.monotonic() + 90
        while True:
            assert superlink.poll() is None and time.monotonic() < deadline, log("superlink")
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=2, context=context):
                    break
            except OSError:
                time.sleep(0.5)
        (operator / "config.toml").write_text(
            f'[superlink]\ndefault = "fedhm"\n\n[superlink.fedhm]\naddress = "127.0.0.1:{port}"\n'
            f'root-certificates = "{server_etc / "ca.pem"}"\n'
        )
        flwr("supernode", "register", str(server_etc / "node.key.pub"), "fedhm")
        device = start("supernode", device_etc)
        deadline = time.monotonic() + 120
        while '"online"' not in flwr("supernode", "list", "fedhm", "--format", "json").stdout:
            assert device.poll() is None and time.monotonic() < deadline, log("supernode")[-3000:]
            time.sleep(2)
        app = subprocess.run([*FEDHM, "stage", str(tmp_path / "app")], cwd=ROOT, capture_output=True, text=True)
        assert app.returncode == 0, app.stderr
        run_dir = tmp_path / "run1"
        started = flwr(
            "run",
            app.stdout.strip(),
            "fedhm",
            "--stream",
            "--run-config",
            f"overrides='{JOB}' output-dir='{run_dir}'",
            timeout=600,
        )
        run_id = re.search(r"Successfully started run (\d+)", started.stdout + started.stderr).group(1)
        listed = flwr("list", "fedhm", "--run-id", run_id, "--format", "json").stdout
        (run,) = json.loads(listed[listed.index("{") :])["runs"]
        assert run["status"] == "finished:completed", (run, log("superlink")[-3000:])
        assert superlink.poll() is None and device.poll() is None
        assert "never connected" not in log("supernode") and "has ended" not in log("superlink")
        # fedhm resume of this device run: refused, naming the command that resumes it on the devices
        resumed = subprocess.run(
            [*FEDHM, "resume", str(run_dir)], cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=120
        )
        assert resumed.returncode == 2 and resumed.stderr.count("\n") == 1, resumed.stderr
        assert f"SuperLink at 127.0.0.1:{port}" in resumed.stderr, resumed.stderr
        assert f"fedhm --stream --run-config \"resume='{run_dir}'\"" in resumed.stderr, resumed.stderr
        assert not (run_dir / "flwr_run.log").exists()  # nothing ran here
    finally:
        procs.close(grace=20.0, settle=3.0)
    assert tagged_pids(procs.tag) == []


# --------------------------------------------------------------------------- fedhm superlink, fedhm resume (fast)

SUPERLINK = """
import os, subprocess, sys, time
from pathlib import Path
here = Path(__file__).resolve().parent
# as Flower: the helper gets --parent-pid, in its own session, writing to the SuperLink's output
subprocess.Popen([str(here / "flower-superexec"), "--parent-pid", str(os.getpid())], start_new_session=True)
print("SuperLink up", flush=True)
time.sleep(60)
"""
SUPEREXEC = """
import time
time.sleep(1.5)
print("Traceback (most recent call last):", flush=True)
print("  File 'x'", flush=True)
print("httpx.ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: IP address mismatch, "
      "certificate is not valid for '127.0.0.1'.", flush=True)
"""


def test_fedhm_superlink_says_its_helper_died_and_exits_1(tmp_path, capsys):
    for name, code in (("flower-superlink", SUPERLINK), ("flower-superexec", SUPEREXEC)):
        (tmp_path / name).write_text(f"#!{sys.executable}\n{code}")
        (tmp_path / name).chmod(0o755)
    t0 = time.monotonic()
    assert link_guard.guard([str(tmp_path / "flower-superlink"), "--insecure"]) == 1
    assert time.monotonic() - t0 < 15
    captured = capsys.readouterr()
    assert "SuperLink up" in captured.out
    (line,) = [ln for ln in captured.err.splitlines() if "[fedhm superlink]" in ln]
    assert "flower-superexec (pid" in line and "has ended" in line and "CERTIFICATE_VERIFY_FAILED" in line, line
    assert "localhost, 127.0.0.1: subjectAltName" in line and "stopping the SuperLink (exit 1)" in line
    # a SuperLink that never starts its helper: said after --helper-wait
    (tmp_path / "flower-superexec").unlink()
    (tmp_path / "flower-superlink").write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    assert link_guard.guard([str(tmp_path / "flower-superlink")], helper_wait=1.0) == 1
    assert "has not started its flower-superexec" in capsys.readouterr().err


def test_fedhm_resume_refuses_a_device_run_with_the_command_that_resumes_it_there(tmp_path, capsys, monkeypatch):
    home = tmp_path / "operator"
    home.mkdir()
    (home / "config.toml").write_text('[superlink.fedhm]\naddress = "fl.example.org:9092"\n')
    monkeypatch.setenv("FLWR_HOME", str(home))
    simulated, flwr_run, deployed = tmp_path / "sim", tmp_path / "flwr-run", tmp_path / "deploy-local"
    device_run.note_superlink(simulated, ["/venv/bin/flwr-simulation"], ("127.0.0.1", 9092))  # a simulation: nothing
    device_run.note_superlink(flwr_run, ["/venv/bin/flwr-serverapp"], ("127.0.0.1", 9092))
    device_run.note_command(deployed, ["fedhm", "deploy-local", "--nodes", "3", "--resume", str(deployed)])
    assert device_run.resume_refusal(simulated) is None
    for run_dir, command in (
        (flwr_run, f'flwr run "$(fedhm stage {flwr_run}-app)" fedhm --stream --run-config "resume=\'{flwr_run}\'"'),
        (deployed, f"fedhm deploy-local --nodes 3 --resume {deployed}"),
    ):
        assert cli.main(["resume", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and err.rstrip().endswith(command), err
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))  # no connection known: the placeholder, said so
    assert "<connection> --stream" in device_run.resume_refusal(flwr_run)


def test_the_launchers_superlink_runs_under_the_guard_and_ends_when_its_helper_died(tmp_path, monkeypatch):
    """start_superlink (the launcher's, deploy-local's) starts flower-superlink under `fedhm superlink`: a
    SuperLink whose helper died ends (exit 1, said in its log) instead of staying up with no run possible."""
    from fedhm_flwr.ops.job import superlink as job_superlink
    from fedhm_flwr.ops.job.procs import new_tag

    for name, code in (("flower-superlink", SUPERLINK), ("flower-superexec", SUPEREXEC)):
        (tmp_path / name).write_text(f"#!{sys.executable}\n{code}")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setattr(job_superlink, "bin_path", lambda name: str(tmp_path / name))
    procs, log = Processes(new_tag()), tmp_path / "superlink.log"
    try:
        proc = job_superlink.start_superlink(procs, free_port(), tmp_path / "state.db", {}, log, wait=False)
        assert proc.wait(timeout=30) == 1
    finally:
        procs.close()
    text = log.read_text()
    assert "SuperLink up" in text and "[fedhm superlink]" in text and "has ended" in text, text
    assert "no run can start; stopping the SuperLink (exit 1)" in text, text


@pytest.mark.parametrize("progress", [False, True])
def test_the_python_api_refuses_to_resume_a_device_run_as_fedhm_resume_does(tmp_path, progress):
    from fedhm_flwr import api
    from fedhm_flwr.config import ConfigError

    deployed = tmp_path / "deploy-local"
    device_run.note_command(deployed, ["fedhm", "deploy-local", "--nodes", "3", "--resume", str(deployed)])
    with pytest.raises(ConfigError) as info:
        api.resume(deployed, progress=progress)
    assert info.value.field == "resume" and "ran on devices" in str(info.value)
    assert str(info.value).endswith(f"Resume it on its devices with: fedhm deploy-local --nodes 3 --resume {deployed}")
