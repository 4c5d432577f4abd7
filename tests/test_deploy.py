"""Real deployment: TLS, SuperNode authentication, capability-declared levels (``fedhm deploy-local``).

Fast tests: credentials, node-config files, capability specs, the memory estimate, the
budget -> level mapping through the in-process grid, what is said of a process that died. Slow
tests: a SuperLink with TLS and SuperNode authentication and real SuperNodes on loopback (``flwr
run``, 2 rounds), the refusal of an unregistered key and of a node without the CA certificate, a
SuperLink stopped with SIGTERM mid-run (its ServerApp gone within seconds, ``fedhm status``
non-zero, the resume going on from the last checkpoint), and the cleanup of every process, also
when the command fails. The ``fedhm supernode`` wrapper: tests/test_supernode_wrapper.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.app import ArrayRecord
from flwr.common.config import parse_config_args
from omegaconf import OmegaConf

from fedhm_flwr import data as D
from fedhm_flwr.config import load_config, model_spec
from fedhm_flwr.models.costs import activation_elements, training_memory_bytes
from fedhm_flwr.ops import deployment as dl
from fedhm_flwr.ops.credentials import add_node, create_credentials
from fedhm_flwr.ops.flower_job import FLOWER_RUN_FILE
from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.outcome import RunFailed, checkpoint_round
from fedhm_flwr.ops.procs import alive, command_name, tagged_pids
from fedhm_flwr.ops.runlock import RunLock
from fedhm_flwr.ops.server_app import initial_state
from fedhm_flwr.ops.supernode import HEARTBEAT_WINDOW, MARGIN
from fedhm_flwr.server.registry import FedHMStrategy

ROOT = Path(__file__).resolve().parent.parent
FEDHM = [sys.executable, "-m", "fedhm_flwr"]  # the `fedhm` command of this checkout (run from ROOT)

HAVE_FMNIST = (
    bool(os.environ.get(D.DATA_DIR_ENV)) or (Path(D.FASHION_MNIST_SYSTEM_DIR) / "train-images-idx3-ubyte.gz").is_file()
)
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason="Fashion-MNIST not installed (make data)")

# the deployment test's job: 1 round of a tiny CNN on 2,000 images (levels over rounds: tests/test_devices.py)
TOY = [
    "rounds=1",
    "num_clients=2",
    "fraction_train=1.0",
    "dataset.max_train_examples=2000",
    "dataset.max_test_examples=500",
    "model.width=8",
    "evaluation.levels=false",
    "timeout=300",
]


def _processes_with(needle: str) -> list[int]:
    found = []  # live processes whose environment mentions ``needle`` (independent of the script's tag)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle.encode() in environ and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _expected_level(strategy: FedHMStrategy, kind: str, budget: float) -> float:
    """The largest level whose cost fits the budget (computed here, not by the strategy)."""
    fits = [lvl for i, lvl in enumerate(strategy.levels) if strategy.method.level_cost(i)[kind] <= budget]
    return max(fits)


# --------------------------------------------------------------------------- fast


def test_memory_estimate_counts_weights_gradients_momentum_and_activations():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model.train()
    assert activation_elements(model, (4,)) == 3 + 3 + 2  # outputs of the three leaf modules
    assert model.training  # mode restored
    params = 4 * 3 + 3 + 3 * 2 + 2
    assert training_memory_bytes(params, 8, batch_size=10) == 4 * (3 * params + 10 * 8)
    assert training_memory_bytes(params, 8, batch_size=10, optimizer_slots=0) == 4 * (2 * params + 10 * 8)


def test_fedhm_level_costs_include_memory_that_follows_the_config():
    cfg = load_config(TOY)
    strategy = FedHMStrategy(cfg, model_spec(cfg))
    costs = [strategy.method.level_cost(i) for i in range(len(strategy.levels))]
    assert all(c["memory"] > 4 * 3 * c["params"] for c in costs)  # weights + grads + momentum + activations
    assert costs[-1]["memory"] < costs[0]["memory"]
    bigger = FedHMStrategy(OmegaConf.merge(cfg, {"train": {"batch_size": 64}}), model_spec(cfg))
    no_momentum = FedHMStrategy(OmegaConf.merge(cfg, {"train": {"momentum": 0.0}}), model_spec(cfg))
    for i, c in enumerate(costs):
        acts = (bigger.method.level_cost(i)["memory"] - c["memory"]) / (4 * (64 - 32))  # activations per input
        assert acts == int(acts) > 0
        assert c["memory"] - no_momentum.method.level_cost(i)["memory"] == 4 * c["params"]  # one momentum buffer


def test_declared_budgets_map_to_the_largest_fitting_level_and_silence_to_the_default():
    cfg = load_config(TOY + ["num_clients=5", "levels.default=0.125"])
    strategy = FedHMStrategy(cfg, model_spec(cfg))
    cost = lambda i, kind: strategy.method.level_cost(i)[kind]  # noqa: E731
    declared = {
        0: {"capability-memory": (cost(1, "memory") + cost(2, "memory")) / 2},
        1: {"capability-macs": (cost(0, "macs") + cost(1, "macs")) / 2},
        2: {"capability-params": cost(3, "params") / 2},  # fits nothing: the smallest level
        3: {"capability-level": 1.0},
        4: {},  # declares nothing: levels.default
    }
    grid = LocalGrid(5, client_handlers(), node_config=lambda i: declared[i])
    msgs = list(
        strategy.configure_train(1, ArrayRecord.from_torch_state_dict(initial_state(cfg, model_spec(cfg))), None, grid)
    )
    got = {strategy.nodes[m.metadata.dst_node_id].partition_id: m.content["config"]["level"] for m in msgs}
    assert got[0] == _expected_level(strategy, "memory", declared[0]["capability-memory"])
    assert got[1] == _expected_level(strategy, "macs", declared[1]["capability-macs"]) == 0.5
    assert got[2] == 0.125 and got[3] == 1.0 and got[4] == 0.125
    assert strategy.round_log.assignments == {f"p{k}": v for k, v in got.items()}  # what metrics.jsonl records


def test_capability_specs_and_node_config_files_round_trip_through_flowers_parser(tmp_path):
    assert dl.parse_capability("level=0.5") == {"capability-level": 0.5}
    assert dl.parse_capability("memory=64M") == {"capability-memory": 64e6}
    assert dl.parse_capability("macs=4e5") == {"capability-macs": 4e5}
    assert dl.parse_capability("-") == {}
    for bad in ("speed=3", "params", "params=abc", "level=0"):
        with pytest.raises(ValueError):
            dl.parse_capability(bad)
    config = dl.node_config(3, 8, {"capability-params": 2e4}, "/data/dev ice 3")
    path = tmp_path / "node-config.toml"
    path.write_text(dl.node_config_toml(config))
    assert parse_config_args([str(path)]) == config  # what flower-supernode --node-config FILE reads


def test_credentials_form_a_chain_and_keys_are_what_flower_reads(tmp_path):
    creds = create_credentials(tmp_path, ["node-0"], sans=["localhost", "127.0.0.1", "10.1.2.3"])
    ca = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate((creds.server_dir / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    node = creds.node_dir("node-0")
    private = load_ssh_private_key((node / "node.key").read_bytes(), None)
    public = load_ssh_public_key((node / "node.pub").read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert private.public_key().public_numbers() == public.public_numbers()
    assert (node / "ca.pem").read_bytes() == creds.ca_cert.read_bytes()
    for secret in (creds.ca_key, creds.server_dir / "server.key", node / "node.key"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600


# --------------------------------------------------------------------------- slow


#: the TLS test's job: TOY over 2 rounds. A SuperLink stopped right after round 1's checkpoint stops the run in
#: round 2: a round through real SuperNodes takes seconds (a node polls every 3 s when idle, then starts a
#: ClientApp process), the test's SIGTERM follows the checkpoint within 0.2 s. No deployment statistics after
#: the last round (one more query to every node, all levels in it, a ClientApp process each; nothing of an
#: export is checked here, tests/test_deploy_docs.py exports)
TLS_JOB = [*TOY, "rounds=2", "evaluation.deploy_stats=false"]


def _serverapps(tag: str) -> list[int]:
    return [p for p in tagged_pids(tag) if command_name(p) == "flwr-serverapp"]


@pytest.mark.slow
@needs_fmnist
def test_tls_deployment_trains_declared_levels_refuses_outsiders_and_resumes_after_a_superlink_sigterm(
    tmp_path, ctrl_c_reaches_children, devices_deployment
):
    # devices_deployment: tests/test_devices.py's deployment runs beside this one, in the background (both
    # mostly wait on Flower's heartbeat windows); its own test checks it
    cfg = load_config(TLS_JOB)
    strategy = FedHMStrategy(cfg, model_spec(cfg))
    cost = lambda i, kind: strategy.method.level_cost(i)[kind]  # noqa: E731
    declared = {  # two nodes, two kinds of budget, two different levels
        "node-0": {"capability-params": (cost(0, "params") + cost(1, "params")) / 2},
        "node-1": {"capability-memory": (cost(1, "memory") + cost(2, "memory")) / 2},
    }
    expected = {
        "p0": _expected_level(strategy, "params", declared["node-0"]["capability-params"]),
        "p1": _expected_level(strategy, "memory", declared["node-1"]["capability-memory"]),
    }
    assert expected == {"p0": 0.5, "p1": 0.25}
    work = tmp_path / "deploy"
    run_dir = tmp_path / "run"
    dep = dl.LocalDeployment(work, say=lambda msg: print(f"[test] {msg}", flush=True))
    pids: list[int] = []
    result: dict = {}
    t0 = time.monotonic()

    def status() -> subprocess.CompletedProcess[str]:  # what docs/DEPLOY.md gives for a deployed run's outcome
        return subprocess.run([*FEDHM, "status", str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)

    def job() -> None:
        try:
            result["summary"] = dep.run_job(TLS_JOB, run_dir, timeout=600, echo=False)
        except BaseException as err:  # reported by the main thread
            result["error"] = err

    try:
        dep.make_credentials(["node-0", "node-1", "no-ca"])
        add_node(dep.creds, "intruder")  # a key pair the SuperLink never learns about
        superlink = dep.start_superlink()
        for name in ("node-0", "node-1", "no-ca"):
            dep.register(name)
        for i, name in enumerate(("node-0", "node-1")):
            dep.start_supernode(name, dl.node_config(i, 2, declared[name]))
        intruder = dep.start_supernode(
            "intruder", dl.node_config(2, 3), max_retries=1, max_wait_time=30, restart_wait=0
        )  # refused for good: no second start
        no_ca = dep.start_supernode("no-ca", dl.node_config(3, 4), with_ca=False, max_retries=1, max_wait_time=30)
        pids = [p.pid for _, p, _ in dep.processes.started]
        dep.wait_online(["node-0", "node-1"])

        # the outsiders are refused and give up
        assert intruder.wait(timeout=120) != 0 and no_ca.wait(timeout=120) != 0
        assert "Failed to activate SuperNode" in dep.log_tail("intruder", 200)
        assert "No SuperNode found with the given public key" in dep.log_tail("superlink", 400)
        assert "CERTIFICATE_VERIFY_FAILED" in dep.log_tail("no-ca", 200)

        # the run; once round 1 is checkpointed, the SuperLink gets SIGTERM (an operator's `kill <pid>`)
        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        deadline = time.monotonic() + 400
        while checkpoint_round(run_dir) is None:
            assert runner.is_alive(), result
            assert time.monotonic() < deadline, "no checkpoint in 400 s"
            time.sleep(0.2)
        os.kill(superlink.pid, signal.SIGTERM)
        t_term = time.monotonic()
        # its ServerApp notices within seconds, records why and exits, freeing the run directory's lock (it
        # used to go on retrying the SuperLink, holding the lock, as long as the SuperLink took to exit)
        while _serverapps(dep.tag) or RunLock.is_held(run_dir):
            assert time.monotonic() - t_term < 20, f"ServerApp {_serverapps(dep.tag)} still there after 20 s"
            time.sleep(0.2)
        print(
            f"[test] ServerApp gone, lock free {time.monotonic() - t_term:.1f} s after the SuperLink's SIGTERM",
            flush=True,
        )
        saved = checkpoint_round(run_dir)
        assert saved == 1, saved  # stopped in mid-run: round 2 was not checkpointed
        stopped = status()
        assert stopped.returncode == 1, stopped.stdout + stopped.stderr
        assert f"last checkpoint: round {saved}" in stopped.stderr and "SuperLink" in stopped.stderr
        # the operator's `flwr run --stream` ends (Ctrl-C): a SuperLink that got SIGTERM waits for its open
        # streams before it exits
        for name, proc, _ in dep.processes.started:
            if name == "flwr-run" and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        runner.join(120)
        assert not runner.is_alive() and "error" in result, result  # the run did not complete
        assert superlink.wait(timeout=120) is not None
        left = json.loads((run_dir / FLOWER_RUN_FILE).read_text())  # the run the stopped session left
        assert left["connection"] == dl.CONNECTION and not left["ended"] and left["run_id"], left

        # the same SuperLink (its database) again; the SuperNodes reconnect; the documented resume
        # (`flwr run ... --run-config "resume='<output-dir>'"`) goes on from the checkpoint's round
        dep.start_superlink()
        dep.wait_online(["node-0", "node-1"], timeout=180)
        t_resume = time.monotonic()
        summary = dep.run_job([], run_dir, timeout=600, echo=False, resume=run_dir)
        print(f"[test] resumed run took {time.monotonic() - t_resume:.0f} s", flush=True)
        assert summary["rounds_completed"] == 2
        assert status().returncode == 0
        # the runner stopped the left run first: left `running`, the devices would wait on its lost
        # round-2 messages until its ServerApp's heartbeats lapsed (45-55 s before the resumed run's
        # nodes answered its start-up query) ...
        superlink_log = dep.log_tail("superlink", 400)
        assert superlink_log.index("ControlServicer.StopRun") < superlink_log.rindex("ControlServicer.StartRun")
        now = json.loads((run_dir / FLOWER_RUN_FILE).read_text())
        assert now["run_id"] != left["run_id"] and now["ended"], now
        # ... so they answer within the time a fresh start takes (9-10 s here), plus the old session's window
        # where a wrapper started its SuperNode afresh (its ClientApp was busy when the SuperLink went away)
        startup = re.findall(r"asked for their node info in ([\d.]+)s", dep.log_tail("flwr-run", 400))
        afresh = any("starting the SuperNode afresh" in dep.log_tail(n, 400) for n in ("node-0", "node-1"))
        assert len(startup) == 2 and float(startup[-1]) < 40 + (HEARTBEAT_WINDOW + MARGIN if afresh else 0), startup

        nodes = {n["node-id"]: n for n in dep.nodes()}
        assert set(nodes) == {str(dep.node_ids[n]) for n in ("node-0", "node-1", "no-ca")}  # no intruder
        assert nodes[str(dep.node_ids["no-ca"])]["online-at"] == "N/A"  # registered, never connected
        log = dep.log_tail("flwr-run", 100000)
        resumed = log[log.index(f"resuming {run_dir.resolve()} after round {saved}") :]
        done = [int(r) for r in re.findall(r"\[round (\d+)/2\]", resumed)]
        assert done == list(range(saved + 1, 3)), done  # the resumed session: round saved+1 on, each once
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2]
        for row in rows:
            assert json.loads(row["assignments"]) == expected  # each node trained the level it can afford
            assert row["replies"] == 2 and row["failures"] == 0 and row["rejected"] == 0
    finally:
        dep.close()
        print(f"[test] deployment test took {time.monotonic() - t0:.0f} s", flush=True)
    assert not [p for p in pids if alive(p)]
    assert tagged_pids(dep.tag) == []
    assert _processes_with(str(work)) == []  # anything with a FLWR_HOME of this deployment


@pytest.mark.slow
@needs_fmnist
def test_fedhm_deploy_local_stops_everything_it_started_when_the_job_fails(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        *FEDHM,
        "deploy-local",
        "--nodes",
        "1",
        "--capabilities",
        "level=0.25",
        "--run-dir",
        str(run_dir),
        "--timeout",
        "1",
        *TOY,
    ]
    # as `make deploy-local` runs it: .venv/bin/python without an activated environment
    env = {
        **os.environ,
        "PATH": os.pathsep.join(
            p
            for p in os.environ.get("PATH", "").split(os.pathsep)
            if Path(p).resolve() != Path(sys.executable).parent.resolve()
        ),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "SuperNode(s) online" in out and "did not finish in 1 s" in out
    time.sleep(1)
    assert _processes_with(str(run_dir)) == [], out[-3000:]
    config = (run_dir / "deploy" / "supernodes" / "node-0" / "node-config.toml").read_text()
    assert "capability-level = 0.25" in config and "num-partitions = 1" in config


def test_a_deployment_names_the_process_that_died_with_its_exit_and_its_last_lines(tmp_path):
    """What `fedhm deploy-local` says when a process it started died (instead of "Flower's output names no
    error"): which one, its exit code or signal, the last lines of its log; one still running is not named."""
    dep = dl.LocalDeployment(tmp_path / "deploy", say=lambda msg: None)
    try:
        env = dep.env(tmp_path / "home")
        programs = {
            "superlink": "import os, signal; print('SuperLink: database locked', flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)",
            "node-1": "print('node-1: out of memory'); raise SystemExit(3)",
            "node-0": "import time; time.sleep(60)",
        }
        procs = {
            name: dep.processes.start(name, [sys.executable, "-c", code], env, dep.logs / f"{name}.log")
            for name, code in programs.items()
        }
        procs["superlink"].wait(timeout=30), procs["node-1"].wait(timeout=30)
        flower_log = dep.logs / "flwr-run.log"
        failed = dep.explain(
            RunFailed(
                "the run did not complete (flwr run: exit code 0, run 7, status None, summary "
                f"not written by this run); Flower's output: {flower_log}",
                log=flower_log,
            )
        )
        text = str(failed)
        assert (
            "why: the SuperLink (flower-superlink) ended: killed by SIGKILL; SuperNode node-1 (fedhm supernode) "
            "ended: exit code 3"
        ) in text, text
        assert "SuperLink: database locked" in text and "node-1: out of memory" in text
        assert "node-0" not in text and "names no error" not in text
        # any other error of a step (a flwr CLI command that failed): the same lines after it
        other = str(dep.explain(RuntimeError("`flwr supernode ls fedhm-local --format json` failed (exit 1)")))
        assert (
            other.startswith("`flwr supernode ls") and "SuperLink (flower-superlink) ended: killed by SIGKILL" in other
        )
        # an error that shows a process's last lines already (wait_online's, start_superlink's): not twice
        shown = RuntimeError(f"... the last lines of {dep.logs / 'node-1.log'}:\nnode-1: out of memory")
        assert str(dep.explain(shown)).count("out of memory") == 1
    finally:
        dep.close()
    assert tagged_pids(dep.tag) == []


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
    line = [ln for b in _deploy_md_blocks() for ln in b.splitlines() if "--credentials-only" in ln][0]
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
