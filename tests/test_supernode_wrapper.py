"""``fedhm supernode`` (fedhm_flwr/ops/deploy/supernode.py) keeps a device running, through real processes.

Stand-ins play Flower's programs (small Python scripts in a temporary folder, no Flower involved):
``flower-supernode`` does at each start what the next word of its plan says (die by SIGKILL, give up
with a Flower exit code, serve until stopped ...), after starting a ``flower-superexec`` that starts a
``flwr-clientapp`` which ignores SIGTERM (as a ClientApp busy in a message may), each with
``--parent-pid`` as Flower passes it. (The units in docs/DEPLOY.md: tests/test_deploy_units.py.)
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhm_flwr.ops.deploy import supernode as sn
from fedhm_flwr.ops.deploy.link_watch import DEFAULT_SUPERLINK
from fedhm_flwr.ops.deploy.node_output import Quiet

ROOT = Path(__file__).resolve().parents[1]

SUPERNODE = '''
"""flower-supernode stand-in: what start n does is word n of ./plan (the last word repeats)."""
import os, signal, subprocess, sys, time
from pathlib import Path

here = Path(__file__).resolve().parent

def alive(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"

runs = here / "runs"
n = len(runs.read_text().splitlines()) if runs.exists() else 0
plan = (here / "plan").read_text().split()
what = plan[min(n, len(plan) - 1)]
earlier = [int(p) for f in here.glob("pids-*") for p in f.read_text().split()]
with runs.open("a") as f:  # the processes of the starts before: all must be gone by now
    f.write(f"{what} left={[p for p in earlier if alive(p)]}\\n")
print(f"start {n}: {what}", flush=True)

def give_up(why):
    print(f"{why}\\nERROR :      Exit Code: 302\\nThe private key is invalid.", flush=True)
    sys.exit(1)

if what == "give-up":
    give_up("a bad key")

def leave(*_):  # as Flower's SuperNode: its line, the default handler back (a second SIGTERM ends it), a goodbye
    print("INFO :      SuperNode terminated gracefully.", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with runs.open("a") as f:
        f.write("got SIGTERM\\n")
    time.sleep(1.5)
    with runs.open("a") as f:
        f.write("said goodbye\\n")
    sys.exit(0)

if what == "serve":  # until SIGTERM (set before anything is started: the test waits for that)
    signal.signal(signal.SIGTERM, leave)
pids = here / f"pids-{n}"
subprocess.Popen([str(here / "flower-superexec"), "--parent-pid", str(os.getpid()), "--out", str(pids)])
deadline = time.monotonic() + 20
while not pids.exists() and time.monotonic() < deadline:  # its superexec and clientapp are up
    time.sleep(0.02)
if what in ("die", "die-later"):
    time.sleep(3.0 if what == "die-later" else 0.0)
    print("last words before the kill", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if what == "serve":
    time.sleep(60)
    sys.exit(3)
'''

SUPEREXEC = """
import os, subprocess, sys, time
from pathlib import Path
here = Path(__file__).resolve().parent
out = Path(sys.argv[sys.argv.index("--out") + 1])
app = subprocess.Popen([str(here / "flwr-clientapp"), "--parent-pid", str(os.getpid())])
out.with_suffix(".tmp").write_text(f"{os.getpid()} {app.pid}")
out.with_suffix(".tmp").replace(out)
time.sleep(120)
"""

CLIENTAPP = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # busy in a message: only SIGKILL ends it
time.sleep(120)
"""


@pytest.fixture
def standins(tmp_path):
    """The stand-ins' folder (:func:`_plan` says what each start does); after the test, none may be left."""
    for name, code in (("flower-supernode", SUPERNODE), ("flower-superexec", SUPEREXEC), ("flwr-clientapp", CLIENTAPP)):
        path = tmp_path / name
        path.write_text(f"#!{sys.executable}\n{code}")
        path.chmod(0o755)
    yield tmp_path
    leftovers = [p for f in tmp_path.glob("pids-*") for p in map(int, f.read_text().split()) if sn.alive(p)]
    for pid in leftovers:  # a failed test leaves nothing behind
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"stand-ins still running: {leftovers}"


def _plan(folder: Path, *words: str) -> None:
    (folder / "plan").write_text(" ".join(words))


def _runs(folder: Path) -> list[str]:
    return (folder / "runs").read_text().splitlines()


def _started(folder: Path) -> list[int]:
    return [p for f in sorted(folder.glob("pids-*")) for p in map(int, f.read_text().split())]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_backoff_doubles_from_one_second_up_to_a_minute():
    assert [sn.backoff(n) for n in range(1, 10)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_the_superlink_counts_as_gone_after_10_s_of_refusals_or_a_heartbeat_window_of_silence():
    watch = sn.LinkWatch()
    assert watch.note("refused", 100.0) is None and watch.note("refused", 109.0) is None
    assert "refused connections for 10 s" in watch.note("refused", 110.0)
    assert watch.note("up", 111.0) is None and watch.note("refused", 115.0) is None  # an answer starts over
    watch = sn.LinkWatch()
    for t in (0.0, 30.0, 59.0):  # a network outage shorter than the window: the node is still online there
        assert watch.note("unreachable", t) is None
    assert watch.note("refused", 59.5) is None  # refusals count from the first refusal, silence from the first miss
    assert "not answered for 60 s" in watch.note("unreachable", 60.0)


def test_the_constants_the_wrapper_keeps_are_flowers():
    constant = importlib.import_module("flwr.common.constant")
    assert sn.HEARTBEAT_WINDOW == constant.HEARTBEAT_PATIENCE * constant.HEARTBEAT_DEFAULT_INTERVAL
    error = importlib.import_module("flwr.supercore.error")
    assert sn.ACTIVATION_FAILED == f"[code: {int(error.ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED)}]"
    assert DEFAULT_SUPERLINK == importlib.import_module("flwr.supercore.constant").SUPERLINK_DEFAULT_CLIENT_ADDRESS
    # the line a SuperNode logs when a signal starts its clean stop
    assert sn.LEAVING in inspect.getsource(importlib.import_module("flwr.supernode.start_client_internal"))
    assert sn.superlink_address(["--superlink", "[::1]:9092"]) == ("::1", 9092)
    assert sn.superlink_address(["--superlink=fl.example.org:8000"]) == ("fl.example.org", 8000)


def test_a_killed_supernode_comes_back_with_backoff_and_what_it_started_ends_first(standins, capsys, monkeypatch):
    monkeypatch.setattr(sn, "KILL_GRACE", 0.5)
    monkeypatch.setattr(sn, "HEALTHY_RUN", 2.0)  # the third start runs 3 s: a healthy run, the back-off starts over
    _plan(standins, "die", "die", "die-later", "give-up")
    waited: list[float] = []
    code = sn.supervise(
        ["--superlink", f"127.0.0.1:{_closed_port()}"], binary=str(standins / "flower-supernode"), sleep=waited.append
    )
    assert code == 1  # Flower's own error exit (a bad key): no restart, its status
    assert waited == [1.0, 2.0, 1.0]
    runs = _runs(standins)
    assert [r.split()[0] for r in runs] == ["die", "die", "die-later", "give-up"]
    assert all(r.endswith("left=[]") for r in runs), runs  # each start's superexec and clientapp ended before the next
    assert len(_started(standins)) == 6 and not [p for p in _started(standins) if sn.alive(p)]
    err = capsys.readouterr().err
    assert err.count("flower-supernode killed by SIGKILL after") == 3
    assert "(its last line: last words before the kill); starting it again in 1 s" in err
    ending = [line for line in err.splitlines() if "ending what the SuperNode started:" in line]
    assert len(ending) == 3 and all("flower-superexec" in line and "flwr-clientapp" in line for line in ending)
    assert "Flower's exit code 302" in err


@pytest.mark.parametrize("to", ["the wrapper", "its process group"])
def test_sigterm_stops_the_wrapper_cleanly_and_ends_every_process_of_the_supernode(standins, to):
    """SIGTERM to the wrapper alone (``kill <pid>``, systemd's KillMode=mixed): it passes it on; to its process
    group (Ctrl-C, systemd's default, deploy-local's stop): the SuperNode got it too, and is not cut short by a
    second one. Either way, the SuperNode says goodbye, everything it started ends, the wrapper exits 0."""
    _plan(standins, "serve")
    with socket.socket() as link:  # the SuperLink's port answers: nothing is ended for its sake
        link.bind(("127.0.0.1", 0))
        link.listen()
        cmd = [
            sys.executable,
            "-m",
            "fedhm_flwr.ops.deploy.supernode",
            "--flower-supernode",
            str(standins / "flower-supernode"),
            "--superlink",
            f"127.0.0.1:{link.getsockname()[1]}",
        ]
        wrapper = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 20
            while not (standins / "pids-0").exists():
                assert wrapper.poll() is None and time.monotonic() < deadline, wrapper.communicate()
                time.sleep(0.05)
            started = _started(standins)
            assert all(sn.alive(p) for p in started)
            t0 = time.monotonic()
            if to == "the wrapper":
                wrapper.send_signal(signal.SIGTERM)
            else:
                os.killpg(wrapper.pid, signal.SIGTERM)
            out, err = wrapper.communicate(timeout=20)
        finally:
            if wrapper.poll() is None:
                wrapper.kill()
    assert wrapper.returncode == 0, err
    assert time.monotonic() - t0 < 1.0 + 1.5 + 3.0 + 4.0  # forwarded after 1 s, its goodbye, the clientapp's SIGKILL
    assert _runs(standins) == ["serve left=[]", "got SIGTERM", "said goodbye"]  # one start, one clean stop
    assert not [p for p in started if sn.alive(p)]
    assert "SIGTERM received" in err and "start 0: serve" in out


def test_a_supernode_whose_superlink_refuses_connections_is_started_afresh_without_its_clientapps(
    standins, capsys, monkeypatch
):
    """A SuperLink that is down (its port refuses connections) under a busy ClientApp: the SuperNode is stopped
    cleanly, what it started is ended, and it starts again at once (no back-off: nothing died)."""
    monkeypatch.setattr(sn, "KILL_GRACE", 0.5)
    _plan(standins, "serve", "give-up")
    waited: list[float] = []
    t0 = time.monotonic()
    code = sn.supervise(
        ["--superlink", f"127.0.0.1:{_closed_port()}"],
        binary=str(standins / "flower-supernode"),
        sleep=waited.append,
        watch=lambda: sn.LinkWatch(refused_patience=1.0),
        probe_every=(0.2, 0.2),
    )
    assert code == 1 and waited == []
    assert _runs(standins) == ["serve left=[]", "got SIGTERM", "said goodbye", "give-up left=[]"]
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert re.search(
        r"the SuperLink at 127\.0\.0\.1:\d+ has refused connections for 1 s .*: the runs of its "
        r"ClientApps \(flwr-clientapp \d+\) are over; starting the SuperNode afresh",
        err,
    ), err


def test_the_supernode_wrapper_waits_out_a_refused_activation_once(tmp_path, capsys):
    """A refused activation: one wait of the heartbeat window, one more start; refused again, it gives up.
    Flower's own error exit (a TLS failure) is not retried."""
    runs = tmp_path / "runs"
    stub = tmp_path / "flower-supernode"

    def make(script: str) -> None:  # a stand-in for flower-supernode: counts its starts
        stub.write_text(f"#!/bin/sh\necho start >> {runs}\n{script}\n")
        stub.chmod(0o755)
        runs.unlink(missing_ok=True)

    # Flower's lines when it ends a SuperNode whose connection failed (its exit code 305; the process exits with 1)
    refused = 'echo "ERROR :      Exit Code: 305"; echo "[code: 2004] Failed to activate SuperNode."; exit 1'
    tls = 'echo "SSL/TLS handshake error detected."; echo "ERROR :      Exit Code: 305"; exit 1'
    # refused once (the killed predecessor's session), then up until Flower ends it (here: a TLS error, not
    # retried): one wait, two starts; the refused one leaves a child holding its output open (as
    # flower-superexec does): no hang, and it is stopped
    child = tmp_path / "child"
    make(
        f'if [ $(wc -l < {runs}) -eq 1 ]; then {sys.executable} -c "import time; time.sleep(300)" --parent-pid $$ & '
        f"echo $! > {child}; {refused}; fi; {tls}"
    )
    waited: list[float] = []
    assert sn.supervise(["--x"], 3.0, str(stub), sleep=waited.append) == 1
    assert len(runs.read_text().splitlines()) == 2 and waited == [3.0]
    captured = capsys.readouterr()
    assert "[code: 2004] Failed to activate SuperNode." in captured.out  # its output passed through
    assert "ending what the SuperNode started" in captured.err and not sn.alive(int(child.read_text()))
    assert "Flower's exit code 305" in captured.err
    # refused for good (an unregistered key): two starts, then its exit status
    make(refused)
    assert sn.supervise([], 0.01, str(stub)) == 1 and len(runs.read_text().splitlines()) == 2
    assert "not registered" in capsys.readouterr().err
    # another connection error (e.g. TLS) or a wait of 0: no second start
    make(tls)
    assert sn.supervise([], 0.01, str(stub)) == 1 and len(runs.read_text().splitlines()) == 1
    make(refused)
    assert sn.supervise([], 0, str(stub)) == 1 and len(runs.read_text().splitlines()) == 1


def test_a_supernode_that_never_connects_is_stopped_with_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    """Flower's SuperNode whose start failed (flower-superexec not on PATH: a traceback, the process kept up by
    its Runtime API server) is stopped within seconds; one that stays silent while its SuperLink's port answers,
    after --connect-timeout. Neither is started again (systemd's unit restarts the wrapper later)."""
    stub, runs = tmp_path / "flower-supernode", tmp_path / "runs"
    stub.write_text(
        f"#!/bin/sh\necho start >> {runs}\n"
        'if [ "$1" = crash ]; then echo "Traceback (most recent call last):"; echo "  File \\"x.py\\", line 1"; '
        "echo \"FileNotFoundError: [Errno 2] No such file or directory: 'flower-superexec'\"; fi\n"
        "exec sleep 60\n"
    )
    stub.chmod(0o755)
    t0 = time.monotonic()
    assert sn.supervise(["crash", "--superlink", f"127.0.0.1:{_closed_port()}"], binary=str(stub)) == 1
    assert time.monotonic() - t0 < 15 and runs.read_text().count("start") == 1
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "never connected" in ln]
    assert "'flower-superexec'" in line and "bin/ on PATH" in line, err
    monkeypatch.setattr(sn, "LINK_UP_FOR", 0.0)
    with socket.socket() as link:  # the SuperLink's port answers, the SuperNode never says it was activated
        link.bind(("127.0.0.1", 0))
        link.listen()
        runs.unlink()
        t0 = time.monotonic()
        code = sn.supervise(
            ["quiet", "--superlink", f"127.0.0.1:{link.getsockname()[1]}"], binary=str(stub), connect_timeout=1.0
        )
    assert code == 1 and time.monotonic() - t0 < 15 and runs.read_text().count("start") == 1
    assert re.search(
        r"never connected: it has not connected in \d+ s although the SuperLink at 127\.0\.0\.1:\d+ answers",
        capsys.readouterr().err,
    )


def test_the_wrapper_reads_a_start_and_leaves_out_only_the_traceback_of_a_clean_exit():
    ended = sn.Ended()
    for line in ("Traceback (most recent call last):", "  File 'a'", "ValueError: boom", "INFO : SuperNode ID: 42"):
        ended.read(line.encode() + b"\n")
    assert ended.crash == "ValueError: boom" and ended.connected
    clean = [
        "INFO : SuperNode terminated gracefully.",
        "Exception ignored in: <module 'threading' from '/usr/lib/python3.11/threading.py'>",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/threading.py", line 1590, in _shutdown',
        "    lock.acquire()",
        "SystemExit: 0",
        "INFO : SuperExec terminated gracefully.",
    ]
    quiet = Quiet()
    shown = [out for ln in clean for out in quiet.feed(ln.encode() + b"\n", leaving=True)]
    assert [s.decode().strip() for s in shown] == [clean[0], clean[-1]] and quiet.dropped == 1
    other = [clean[1], clean[2], "    x()", "RuntimeError: not a clean exit"]
    quiet = Quiet()
    assert [o for ln in other for o in quiet.feed(ln.encode() + b"\n", leaving=True)] == [
        ln.encode() + b"\n" for ln in other
    ]
    assert Quiet().feed(clean[1].encode(), leaving=False) == [clean[1].encode()]  # before the goodbye: all shown
