"""Figure 10 (bench/startup.py): a job's time outside its rounds, its parts and its ratio to the start-up
floor, computed from made-up records (nothing timed here); the floor (bench/startup_floor.py) imports
nothing of the project."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_bench_floors import _modules

from bench import startup, startup_floor
from bench.run import FIGURES, markdown

FLOOR_OUT = {
    "main_started_at": 100.2,
    "imported_at": 102.0,
    "ray_ready_at": 104.5,
    "workers": [
        {"call_started_at": 105.0, "imported_at": 105.9, "decoded_at": 106.3},
        {"call_started_at": 105.1, "imported_at": 106.0, "decoded_at": 106.4},
    ],
    "workers_ready_at": 106.5,
    "finished_at": 107.0,
}
#: a launched job: process spawned at 0, round 1 at 20, two rounds of 5 s, records until 31, exit at 35
MARKS = {
    "launcher_process_started_at": 0.1,
    "launcher_started_at": 1.0,
    "checked_at": 2.0,
    "superlink_ready_at": 3.0,
    "app_staged_at": 3.5,
    "flwr_run_started_at": 3.6,
    "flwr_run_exited_at": 32.0,
    "status_checked_at": 33.0,
    "cleaned_up_at": 34.0,
}
SUMMARY = {
    "rounds_started_at": 20.0,
    "finished_at": 31.0,
    "startup_marks": {
        "simulation_started_at": 5.0,
        "serverapp_main_at": 8.0,
        "startup_started_at": 10.0,
        "rounds_started_at": 20.0,
    },
}
ROWS = [{"round": 1, "seconds": 5.0}, {"round": 2, "seconds": 5.0}]


def test_the_floor_parts_add_up_to_its_spawn_to_exit_time():
    parts = startup.floor_parts(100.0, 107.5, FLOOR_OUT)
    assert math.isclose(sum(parts.values()), 7.5)
    assert parts["ray.init"] == pytest.approx(2.5) and parts["actors start"] == pytest.approx(0.5)
    assert parts["actors import torch and decode the data"] == pytest.approx(1.5)


def test_a_jobs_time_outside_its_rounds_is_its_wall_less_its_rounds_and_its_parts_add_up():
    job = startup.outside_rounds(0.0, 35.0, MARKS, SUMMARY, ROWS)
    assert job["wall_seconds"] == 35.0 and job["rounds_seconds"] == 10.0 and job["outside_seconds"] == 25.0
    assert job["before_round_1_seconds"] == pytest.approx(20.0)  # spawn to round 1
    assert list(job["before_round_1"])[:3] == [
        "process spawn",
        "launcher: Python start and imports",
        "config and data check",
    ]
    assert math.isclose(job["before_round_1_seconds"] + sum(job["end"].values()), job["outside_seconds"])
    assert job["end"]["ServerApp: records after the rounds"] == pytest.approx(1.0)  # 31 - 20 - 10


def test_a_sweep_jobs_time_runs_from_its_launch_to_its_clean_up_and_the_written_parts_are_used():
    written = {**MARKS, "startup_parts": {"all of the start-up": 19.9}}
    job = startup.outside_rounds(None, MARKS["cleaned_up_at"], written, SUMMARY, ROWS)
    assert job["wall_seconds"] == pytest.approx(33.9) and job["before_round_1"] == {"all of the start-up": 19.9}
    assert "process exit" not in job["end"]


def test_the_ratios_and_the_report_section():
    floor = startup.floor_parts(100.0, 107.5, FLOOR_OUT)
    job = startup.outside_rounds(0.0, 35.0, MARKS, SUMMARY, ROWS)
    job.update(overrides=[], **startup.ratios(job, floor))
    assert job["outside_ratio"] == pytest.approx(25.0 / 7.5)
    assert job["before_round_1_ratio"] == pytest.approx(20.0 / (7.5 - 0.5 - 0.5))
    figure = {"floor": floor, "jobs": {"default job": job}, "target": startup.TARGET}
    assert FIGURES["10"][0] == "10_startup"
    text = markdown({"machine": "here", "figures": {"10_startup": figure}})
    assert (
        "## 10. Time outside the rounds" in text
        and "**3.33**" in text
        and "| before round 1: SuperLink start | 1.00 |" in text
    )


def test_the_floor_imports_nothing_from_the_project():
    imported = _modules(Path(startup_floor.__file__))
    ours = {m for m in imported if m.split(".")[0] in ("fedhm_flwr", "strategies", "clients", "bench")}
    assert ours == {"bench.whole_job_floor"}, ours  # (itself checked in tests/test_bench_floors.py)
    assert {"torch", "ray", "flwr.app", "flwr.serverapp"} <= imported
