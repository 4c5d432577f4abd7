"""Where the seconds before round 1 go: the start-up's marks turned into parts (pure, on made-up
marks), the first nodes' marks read from untrusted replies, the launcher's marks file, a process's start,
and an in-process run whose summary and ``fedhm status`` line carry the parts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
from data_helpers import needs_fmnist
from flwr.app import ConfigRecord, Context, RecordDict

from fedhm_flwr.core import protocol
from fedhm_flwr.ops.apps import server_app
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.job.status import run_status
from fedhm_flwr.reporting.startup import (
    PARTS,
    TIMINGS_FILE,
    launcher_marks,
    parts_line,
    process_started_at,
    startup_parts,
)

#: every mark of a launched job, one second apart but the worker's, which started during the set-up
MARKS = {mark: 100.0 + i for i, (mark, _) in enumerate(PARTS)}
MARKS["worker_started_at"] = MARKS["serverapp_main_at"] + 0.5


def test_the_parts_follow_the_path_and_add_up_to_the_wait():
    parts = startup_parts(MARKS)
    assert list(parts) == [part for _, part in PARTS[1:]]  # in path order, the first mark starts the clock
    assert math.isclose(sum(parts.values()), MARKS["rounds_started_at"] - MARKS["launcher_process_started_at"])
    # the worker started before the set-up ended: nothing of the wait is its start; its imports end 2 s after the set-up
    assert parts["Ray start and the first worker process (what is left of it)"] == 0.0
    assert parts["the worker's imports (Ray worker, torch, flwr, the ClientApp)"] == 2.0
    assert all(seconds >= 0 for seconds in parts.values())


def test_a_missing_or_bad_mark_gives_its_time_to_the_next_part():
    marks = {**MARKS, "superlink_ready_at": None, "app_staged_at": math.nan, "checked_at": True}
    parts = startup_parts(marks)
    assert "SuperLink start" not in parts and "app staging" not in parts and "config and data check" not in parts
    flwr_run = "flwr run: app bundle, submission, simulation process start"
    assert parts[flwr_run] == MARKS["simulation_started_at"] - MARKS["launcher_started_at"]
    assert math.isclose(sum(parts.values()), MARKS["rounds_started_at"] - MARKS["launcher_process_started_at"])
    # an in-process run (no launcher): the clock starts at the ServerApp's start
    own = {k: v for k, v in MARKS.items() if k in ("serverapp_main_at", "startup_started_at", "rounds_started_at")}
    assert list(startup_parts(own).values()) == [1.0, 5.0]
    assert startup_parts({"rounds_started_at": 3.0}) == {}


def test_the_line_names_the_total_and_the_parts_largest_first():
    line = parts_line({"a": 1.0, "b": 3.0, "c": 0.01})
    assert line == "4.0 s before round 1: b 3.0 s; a 1.0 s"


def test_the_first_marks_are_the_earliest_finite_floats_the_replies_give():
    good = protocol.worker_marks(5.0, 7.0, 9.0)
    later = protocol.worker_marks(6.0, 6.5, 8.0)
    hostile = {protocol.WORKER_STARTED_AT: math.nan, protocol.WORKER_IMPORTED_AT: "1", protocol.ANSWERED_AT: -math.inf}
    replies = [RecordDict({protocol.METRICS: good}), {protocol.METRICS: hostile}, RecordDict({protocol.METRICS: later})]
    replies.append(RecordDict({protocol.CONFIG: ConfigRecord({protocol.ANSWERED_AT: 1.0})}))  # not its metrics
    marks = protocol.first_marks(replies, {"worker_started_at": 5.5}, arrived=10.0)
    assert marks == {
        "worker_started_at": 5.0,
        "worker_imported_at": 6.5,
        "first_answered_at": 8.0,
        "first_arrived_at": 10.0,
    }
    assert protocol.first_marks([], marks, arrived=12.0)["first_arrived_at"] == 10.0  # a later pull: not the first
    assert protocol.WORKER_STARTED_AT not in protocol.worker_marks(None, 1.0, 2.0)


def test_the_serverapp_reads_the_launchers_marks_of_this_session_only(tmp_path):
    assert launcher_marks(tmp_path) == {}
    (tmp_path / TIMINGS_FILE).write_text(json.dumps({"launcher_started_at": 1.5, "checked_at": 2, "note": "x"}))
    assert launcher_marks(tmp_path) == {"launcher_started_at": 1.5, "checked_at": 2.0}
    (tmp_path / TIMINGS_FILE).write_text(json.dumps({"launcher_started_at": 1.5, "cleaned_up_at": 9.0}))
    assert launcher_marks(tmp_path) == {}  # an earlier session's whole record
    (tmp_path / TIMINGS_FILE).write_text("{broken")
    assert launcher_marks(tmp_path) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_process_start_lies_between_the_times_around_its_spawn():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = time.time()
        started = process_started_at(child.pid)
        assert started is not None and before - 0.05 <= started <= after + 0.05
    finally:
        child.kill()
        child.wait()
    assert process_started_at(2**22 + 12345) is None  # no such process


@needs_fmnist
def test_an_in_process_run_records_its_start_up_by_part_and_status_says_it(toy_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(server_app, "load_config", lambda overrides: toy_cfg(f"rounds=1 {overrides}"))
    run_dir = tmp_path / "run"
    run_config = {"overrides": "num_clients=2 evaluation.levels=false", "output-dir": str(run_dir)}
    server_app.main(LocalGrid(2, client_handlers()), Context(1, 0, {}, RecordDict(), run_config))
    summary = json.loads((run_dir / "summary.json").read_text())
    marks, parts = summary["startup_marks"], summary["startup_parts"]
    # no launcher, no Ray: the ServerApp's own marks and the first answer's arrival
    assert list(marks) == ["serverapp_main_at", "startup_started_at", "first_arrived_at", "rounds_started_at"]
    assert list(parts) == [
        "ServerApp set-up: config, test set, model, strategy (Ray starts meanwhile)",
        "its way to the ServerApp",
        "the other nodes' node-info answers",
    ]
    assert math.isclose(sum(parts.values()), marks["rounds_started_at"] - marks["serverapp_main_at"], abs_tol=1e-6)
    code, line = run_status(run_dir)
    assert code == 0 and line.startswith(f"{run_dir}: completed (1/1 rounds); ") and "s before round 1: " in line


def test_a_simulated_worker_tells_its_marks_in_its_first_node_info_answer_only(monkeypatch):
    from types import SimpleNamespace

    from fedhm_flwr.client import handlers

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    # (a Message needs a run to be made in: the handler reads only its content)
    query = SimpleNamespace(content=RecordDict({protocol.CONFIG: ConfigRecord({protocol.QUERY: protocol.NODE_INFO})}))
    monkeypatch.setattr(handlers, "_MARKS_TOLD", [])
    assert protocol.METRICS not in handlers.node_info_reply(query, context)  # not under Ray: a deployment's node
    monkeypatch.setattr(handlers, "ray_node_id", lambda: "a-ray-node")
    first, second = (handlers.node_info_reply(query, context) for _ in range(2))
    marks = protocol.first_marks([first], {})
    assert set(marks) == {"worker_started_at", "worker_imported_at", "first_answered_at"}
    assert marks["worker_started_at"] <= marks["worker_imported_at"] <= marks["first_answered_at"] <= time.time()
    assert protocol.METRICS not in second


def test_fedhm_run_prints_the_start_up_line_before_its_last_line(monkeypatch, capsys):
    from fedhm_flwr.ops import cli

    summary = {"startup_parts": {"config and data check": 1.0, "SuperLink start": 2.0}}
    monkeypatch.setattr(cli, "run_with_progress", lambda *a, **k: summary)
    monkeypatch.setattr(cli, "report_finished", lambda s: print("run complete") or 0)
    assert cli._run_job([], None, None, progress=True) == 0
    assert capsys.readouterr().out.splitlines() == [
        "start-up: 3.0 s before round 1: SuperLink start 2.0 s; config and data check 1.0 s",
        "run complete",
    ]
