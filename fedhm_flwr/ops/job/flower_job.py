"""One ``flwr run`` of the app, judged by its own run id: :class:`FlowerJob` and :func:`run_flower_job`.

``flwr run --stream`` exits 0 whatever became of the run, so the runner reads its own run id
from the output, asks the SuperLink for that run's final status (``flwr list --run-id <id>``) and
checks that the run wrote its summary; on the way it picks the first ServerApp / client error
out of Flower's output (:class:`ErrorScan`), the one line a failed run reports. The launcher
(simulation) and ``fedhm deploy-local`` (a TLS deployment on loopback) both run their job here.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from fedhm_flwr.ops.job import control
from fedhm_flwr.ops.job.outcome import Commands, RunFailed, exit_status, resume_hint
from fedhm_flwr.ops.job.procs import Processes, kill_serverapp, killpg_quietly
from fedhm_flwr.ops.job.runlock import RunLock
from fedhm_flwr.ops.job.superlink import APP_DIR, bin_path
from fedhm_flwr.reporting.results import SUMMARY_FILE

STARTED_RUN = re.compile(r"Successfully started run (\d+)")
#: the Flower run writing a run directory (``<run dir>/flower_run.json``: its run id, its SuperLink
#: connection, whether it was seen to end): the next session of the directory stops it if it was not
FLOWER_RUN_FILE = "flower_run.json"
#: Flower's line before the traceback of a ServerApp (deployment) / simulation (its ServerApp) exception
APP_RAISED = re.compile(r"\b(ServerApp|Simulation) raised an exception")
#: the strategy's warnings about a node's error (fedhm_flwr/server/strategy.py, fedhm_flwr/server/nodes.py)
NODE_ERROR = re.compile(r"(round \d+: node \S+ failed: .+|node \S+ cannot take part: .+)$")
#: the line of a Python traceback that names the exception: ``ValueError: ...``, ``flwr.x.Error: ...``
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$")
#: a node's error reason that only wraps the client's exception (the simulation's Ray actor error)
WRAPPED = re.compile(r"<class '[\w.]+\.\w+(?:\([\w.]+\))?'>:?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ErrorScan:
    """The first errors in a run's streamed output: the ServerApp's exception (the exception line
    of the traceback Flower logs after "ServerApp / Simulation raised an exception") and the first
    error of a node (the strategy's "node ... failed: <reason>" / "cannot take part" warnings:
    the client's exception, e.g. an unreadable image with its path). One line each."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.server: str | None = None
        self.client: str | None = None
        self.say = say  # told each first error at once (the console of a quiet run), one line
        self._in_traceback = False
        self._client_head: str | None = None
        self._client_lines = 0

    def _tell_client(self, text: str) -> None:
        self.client = " ".join(text.split())[:600]
        self._client_head = None
        if self.say is not None:
            self.say(f"first client error: {self.client}")

    def feed(self, line: str) -> None:
        text = ANSI.sub("", line).rstrip()
        if self.client is None:
            if self._client_head is not None:  # the reason was a wrapper: the client's own exception follows
                self._client_lines += 1
                if EXCEPTION_LINE.match(text.strip()) or self._client_lines > 80:
                    self._tell_client(f"{self._client_head} {text.strip() if self._client_lines <= 80 else ''}")
            elif match := NODE_ERROR.search(text):
                found = match.group(1)
                if WRAPPED.search(found):  # Ray's "<class 'ray.exceptions.RayTaskError(...)'>:<..." + traceback
                    wrapper = cast("re.Match[str]", WRAPPED.search(found)).group(0)  # (it just matched)
                    self._client_head, self._client_lines = found[: found.index(wrapper)], 0
                else:
                    self._tell_client(found)
        if self.server is None:
            if APP_RAISED.search(text):
                self._in_traceback = True
            elif self._in_traceback and EXCEPTION_LINE.match(text.strip()):
                self.server = text.strip()[:600]
                self._in_traceback = False
                if self.say is not None:
                    self.say(f"ServerApp error: {self.server}")

    def reason(self) -> str | None:
        """One line: why the run failed, as far as its output says."""
        parts = ([f"ServerApp: {self.server}"] if self.server else []) + (
            [f"first client error: {self.client}"] if self.client else []
        )
        return "; ".join(parts) or None


class FlowerJob:
    """One ``flwr run`` of the app on a SuperLink connection, judged by its own run id.

    ``env`` is the CLI's environment (``FLWR_HOME`` holding a ``config.toml`` that names
    ``connection``); every CLI process is started through ``procs`` (tagged, own session)."""

    def __init__(
        self,
        procs: Processes,
        env: dict[str, str],
        connection: str,
        log_file: Path,
        echo: bool = True,
        on_error: Callable[[str], None] | None = None,
        run_tag: str | None = None,
    ) -> None:
        self.procs, self.env, self.connection, self.log_file, self.echo = procs, env, connection, log_file, echo
        # the tag of the processes that host the run: the job's own, or a sweep's shared SuperLink's
        self.run_tag = run_tag or procs.tag
        self.run_id: int | None = None
        self.record_path: Path | None = None  # where the run is recorded (:data:`FLOWER_RUN_FILE`), if anywhere
        self.timed_out = False  # flwr run was killed for taking longer than its timeout
        self.errors = ErrorScan(on_error)  # on_error: told the first errors as they appear (quiet runs)
        self.marks: dict[str, float] = {}  # when flwr run started, named its run, exited (wall clock: timings.json)

    def cli(self, *args: str, timeout: float = 60) -> dict[str, Any]:
        """A ``flwr`` command with ``--format json`` on this connection; its JSON answer ({} if none).
        ``list --run-id ID`` and ``stop ID`` are answered in this process where Flower's CLI parts are
        there (:mod:`fedhm_flwr.ops.job.control`: the same calls, without a CLI process's start)."""
        if (args[:2] == ("list", "--run-id") and len(args) == 3) or (args[:1] == ("stop",) and len(args) == 2):
            answer = control.ask(self.env, self.connection, args[0], int(args[-1]), timeout)
            if answer is not None:
                return answer
        try:
            out = self.procs.run(
                [bin_path("flwr"), *args, self.connection, "--format", "json"], self.env, timeout=timeout, cwd=APP_DIR
            ).stdout
            return dict(json.loads(out[out.index("{") :]))
        except (ValueError, subprocess.SubprocessError, OSError):
            return {}

    def run(
        self,
        app: Path,
        run_config: Path,
        extra: Sequence[str] = (),
        timeout: float | None = None,
        record: Path | None = None,
    ) -> int:
        """``flwr run <app> <connection> --stream``: copy its output to the log (and the console),
        note the run id (and record it in ``record``, :data:`FLOWER_RUN_FILE`, as soon as Flower names
        it: :meth:`stop` and :meth:`status` mark it ended there); returns its exit code. Raises
        :class:`TimeoutError` after ``timeout`` s."""
        self.record_path = record
        cmd = [bin_path("flwr"), "run", str(app), self.connection, "--stream", "--run-config", str(run_config), *extra]
        self.marks["flwr_run_started_at"] = time.time()
        proc = self.procs.start("flwr-run", cmd, self.env, None, cwd=APP_DIR)
        timer = threading.Timer(timeout, killpg_quietly, (proc.pid, signal.SIGKILL)) if timeout else None
        if timer is not None:
            timer.start()
        try:
            assert proc.stdout is not None
            with self.log_file.open("ab") as log:
                for raw in proc.stdout:
                    log.write(raw)
                    log.flush()
                    if self.echo:
                        sys.stdout.write(raw.decode(errors="replace"))
                        sys.stdout.flush()
                    line = raw.decode(errors="replace")
                    self.errors.feed(line)
                    if self.run_id is None and (match := STARTED_RUN.search(line)):
                        self.run_id = int(match.group(1))
                        self.marks["run_started_at"] = time.time()  # the app bundled, sent and the run created
                        self.record(ended=False)
                        control.warm()  # for the status asked at the end (and a stop on Ctrl-C)
            code = proc.wait()
            self.marks["flwr_run_exited_at"] = time.time()
        finally:
            if timer is not None:
                timer.cancel()
        if timer is not None and code == -signal.SIGKILL:
            self.timed_out = True
            raise TimeoutError(f"flwr run did not finish in {timeout:g} s")
        return code

    def record(self, ended: bool) -> None:
        """Write :data:`FLOWER_RUN_FILE` (when the run is recorded): run id, connection, whether it ended."""
        if self.record_path is not None:
            self.record_path.write_text(
                json.dumps({"run_id": self.run_id, "connection": self.connection, "ended": ended}) + "\n"
            )

    def stop_earlier(self, path: Path) -> bool:
        """``flwr stop`` of the run an earlier session recorded in ``path`` (:data:`FLOWER_RUN_FILE`)
        on this connection, unless it was seen to end; True if the SuperLink confirmed.

        Nothing while another session holds the run directory's lock (:class:`RunLock`): its run is
        live. With the lock free or this job's own, no session of the directory is live, and that run
        is left over. Why stop it: a SuperLink restarted from its database keeps a run whose
        ServerApp died ``running`` until that ServerApp's heartbeats lapse (2 × 30 s after its last
        one, Flower 1.42), and the SuperNodes wait on the run's lost messages all that time before
        they answer the next run. Once they have lapsed Flower has ended the run itself and refuses
        the stop (``[code: 18] Run is already finished``): False, and nothing is left to do."""
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if RunLock.is_held(path.parent) and RunLock(path.parent).holder().get("tag") != self.procs.tag:
            return False
        if earlier.get("ended") or earlier.get("connection") != self.connection or earlier.get("run_id") is None:
            return False
        return bool(self.cli("stop", str(int(earlier["run_id"])), timeout=15).get("success"))

    def status(self, wait: float = 10.0) -> str | None:
        """The final status of this job's run (``finished:completed``, ...), None if unknown.

        Waits up to ``wait`` s while the SuperLink still reports it as not finished; None at once
        when no SuperLink answers (stopped under the run, unreachable: each ask is a CLI start)."""
        if self.run_id is None:
            return None
        deadline = time.monotonic() + wait
        while True:
            answer = self.cli("list", "--run-id", str(self.run_id))
            if not answer or answer.get("success") is False:
                return None
            runs = answer.get("runs", [])
            status = str(runs[0].get("status")) if runs else None
            if (status or "").startswith("finished"):
                self.record(ended=True)
                return status
            if time.monotonic() > deadline:
                return status
            time.sleep(1.0)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the run: kill the ServerApp at once (it keeps its last checkpoint and records
        nothing more), then ``flwr stop <run id>``, best effort within ``timeout`` s, so the
        SuperLink marks the run stopped. True if the SuperLink confirmed."""
        kill_serverapp(self.run_tag)
        if self.run_id is None:
            return False
        stopped = bool(self.cli("stop", str(self.run_id), timeout=timeout).get("success"))
        if stopped:
            self.record(ended=True)
        return stopped


def run_flower_job(
    job: FlowerJob,
    app: Path,
    run_config: Path,
    run_dir: Path,
    extra: Sequence[str] = (),
    timeout: float | None = None,
    see: str = "",
    commands: Commands | None = None,
) -> dict[str, Any]:
    """Run ``job`` to its end and return the summary the run wrote.

    Raises :class:`RunFailed` unless ``flwr run`` exited 0, this run's own status is
    ``finished:completed`` and ``summary.json`` was written by this run (with the first error of
    the ServerApp or a client that Flower's output shows, and the resume command in ``commands``'
    terms when a checkpoint is there). On a timeout or an interrupt (Ctrl-C, :class:`Interrupted`)
    the Flower run is stopped first (``flwr stop``). Before it starts, the Flower run an earlier
    session of ``run_dir`` left running is stopped (:meth:`FlowerJob.stop_earlier`)."""
    started = time.time()

    def failed(message: str) -> RunFailed:
        resume = resume_hint(run_dir, commands, [])[1] if commands is not None else None
        return RunFailed(
            f"{message}; Flower's output: {job.log_file}{see}", run_dir, job.errors.reason(), job.log_file, resume
        )

    record = run_dir / FLOWER_RUN_FILE
    job.stop_earlier(record)
    try:
        code = job.run(app, run_config, extra, timeout, record=record)
    except TimeoutError as err:
        job.stop()
        raise failed(str(err)) from None
    except KeyboardInterrupt:
        job.stop()
        raise
    status = job.status()
    job.marks["status_checked_at"] = time.time()
    summary_file = run_dir / SUMMARY_FILE
    fresh = summary_file.is_file() and summary_file.stat().st_mtime >= started - 1
    if code != 0 or status != "finished:completed" or not fresh:
        raise failed(
            f"the run did not complete (flwr run: {exit_status(code)}, run {job.run_id}, status {status!r}, "
            f"summary {'written' if fresh else 'not written'} by this run)"
        )
    return dict(json.loads(summary_file.read_text()))
