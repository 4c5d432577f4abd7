"""Real deployment: TLS, SuperNode authentication, capability-declared levels (``fedhm deploy-local``).

Fast test: what is said of a process that died (the memory estimate, capability specs, the budget
-> level mapping and credentials: tests/test_capabilities.py). Slow
tests: a SuperLink with TLS and SuperNode authentication and real SuperNodes on loopback (``flwr
run``, 2 rounds), the refusal of an unregistered key and of a node without the CA certificate, a
SuperLink stopped with SIGTERM mid-round while a ClientApp trains on each device (its ServerApp gone
within seconds, no process of those SuperNode starts left on either device 30 s later, ``fedhm
status`` non-zero, the resume going on from the last checkpoint), and the cleanup of every process, also
when the command fails. The ``fedhm supernode`` wrapper: tests/test_supernode_wrapper.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from lifecycle_helpers import supernode_starts

from fedhm_flwr import data as D
from fedhm_flwr.config import load_config, model_spec, run_options
from fedhm_flwr.ops.deploy import loopback as dl
from fedhm_flwr.ops.deploy.credentials import add_node
from fedhm_flwr.ops.deploy.supernode import HEARTBEAT_WINDOW, MARGIN
from fedhm_flwr.ops.job.flower_job import FLOWER_RUN_FILE
from fedhm_flwr.ops.job.outcome import RunFailed, checkpoint_round
from fedhm_flwr.ops.job.procs import alive, command_name, tagged_pids
from fedhm_flwr.ops.job.runlock import RunLock
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
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
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
        except BaseException as err:  # noqa: BLE001  any failure of the job thread is reported by the main thread
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

        # the run; once round 1 is checkpointed and round 2's training has a ClientApp busy on each device (not one
        # of round 1's), the SuperLink gets SIGTERM (an operator's `kill <pid>`)
        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        deadline = time.monotonic() + 400
        while checkpoint_round(run_dir) is None:
            assert runner.is_alive(), result
            assert time.monotonic() < deadline, "no checkpoint in 400 s"
            time.sleep(0.2)
        earlier = {pid for start in supernode_starts(str(work)).values() for pid in start}
        deadline = time.monotonic() + 120
        while (
            len(
                busy := {
                    tag
                    for tag, start in supernode_starts(str(work)).items()
                    if any(name == "flwr-clientapp" and pid not in earlier for pid, name in start.items())
                }
            )
            < 2
        ):
            assert runner.is_alive(), result
            assert time.monotonic() < deadline, f"round 2: a ClientApp busy on {len(busy)} device(s) in 120 s"
            time.sleep(0.1)
        os.kill(superlink.pid, signal.SIGTERM)
        t_term = time.monotonic()
        at_stop = {tag: start for tag, start in supernode_starts(str(work)).items() if tag in busy}
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
        # within 30 s of the SIGTERM the ClientApps busy at the stop are gone on both devices (their message done,
        # or ended with their SuperNode by its wrapper, which starts a SuperNode afresh once the SuperLink's port
        # has refused connections for 10 s while ClientApps run); 30 s after it no ClientApp runs on any device
        apps_at_stop = {p for start in at_stop.values() for p, name in start.items() if name == "flwr-clientapp"}
        while alive_apps := [p for p in apps_at_stop if alive(p)]:
            assert time.monotonic() - t_term < 30, f"ClientApps {alive_apps} still running 30 s after the SIGTERM"
            time.sleep(0.2)
        afresh = [n for n in ("node-0", "node-1") if "starting the SuperNode afresh" in dep.log_tail(n, 400)]
        print(
            f"[test] the {len(apps_at_stop)} ClientApps busy at the stop gone {time.monotonic() - t_term:.1f} s "
            f"after the SuperLink's SIGTERM; SuperNodes started afresh: {afresh or 'none'}",
            flush=True,
        )
        time.sleep(max(0.0, t_term + 30 - time.monotonic()))
        now = supernode_starts(str(work))
        assert [p for start in now.values() for p, name in start.items() if name == "flwr-clientapp"] == [], now
        # a SuperNode started afresh left nothing of its start behind: SuperNode, SuperExec, ClientApps
        assert len([tag for tag in at_stop if tag not in now]) >= len(afresh), (afresh, at_stop, now)
        left = json.loads((run_dir / FLOWER_RUN_FILE).read_text())  # the run the stopped session left
        assert left["connection"] == dl.CONNECTION and not left["ended"] and left["run_id"], left

        # the same SuperLink (its database) again, once the old sessions of the SuperNodes started afresh have
        # lapsed: restarted sooner, it lists them online while it refuses the fresh ones for that window, and a
        # resume then finds them unavailable (docs/DEPLOY.md, "A SuperLink stopped mid-run")
        time.sleep(max(0.0, t_term + HEARTBEAT_WINDOW + MARGIN - time.monotonic()))
        # the SuperNodes reconnect; the documented resume
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
            assert json.loads(row["assignments"]) == expected, row  # each node trained the level it can afford
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
