"""The runner's record of its Flower run (fedhm_flwr/ops/job/flower_job.py, ``flower_run.json``): the next
session of a run directory stops the run an earlier session left running, and nothing else."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fedhm_flwr.ops.job.flower_job import FLOWER_RUN_FILE, FlowerJob
from fedhm_flwr.ops.job.runlock import RunLock


def _job(tmp_path, tag="session-2", connection="local"):
    job = FlowerJob(SimpleNamespace(tag=tag), {}, connection, tmp_path / "flwr.log", echo=False)
    job.asked = []
    job.cli = lambda *args, timeout=60: job.asked.append(args) or {"success": True}
    return job


def _left_by_earlier_session(run_dir, run_id=7, ended=False, connection="local"):
    earlier = _job(run_dir, tag="session-1", connection=connection)
    earlier.run_id, earlier.record_path = run_id, run_dir / FLOWER_RUN_FILE
    earlier.record(ended=ended)


def test_a_run_left_running_by_an_earlier_session_is_stopped_once_by_its_run_id(tmp_path):
    _left_by_earlier_session(tmp_path, run_id=9193151436848936554)
    job = _job(tmp_path)
    assert job.stop_earlier(tmp_path / FLOWER_RUN_FILE)
    assert job.asked == [("stop", "9193151436848936554")]
    with RunLock(tmp_path, "session-2"):  # the session's own lock (the launcher holds it) does not stop it
        assert job.stop_earlier(tmp_path / FLOWER_RUN_FILE)


def test_an_ended_run_another_superlinks_run_a_live_sessions_run_or_no_record_is_left_alone(tmp_path):
    job = _job(tmp_path)
    assert not job.stop_earlier(tmp_path / FLOWER_RUN_FILE)  # no earlier session
    (tmp_path / FLOWER_RUN_FILE).write_text("{not json")
    assert not job.stop_earlier(tmp_path / FLOWER_RUN_FILE)
    _left_by_earlier_session(tmp_path, ended=True)
    assert not job.stop_earlier(tmp_path / FLOWER_RUN_FILE)
    _left_by_earlier_session(tmp_path, connection="another-superlink")
    assert not job.stop_earlier(tmp_path / FLOWER_RUN_FILE)
    _left_by_earlier_session(tmp_path)
    with RunLock(tmp_path, "session-1"):  # that session is live: its run is not left over
        assert not job.stop_earlier(tmp_path / FLOWER_RUN_FILE)
    assert job.asked == []
    assert json.loads((tmp_path / FLOWER_RUN_FILE).read_text()) == {"run_id": 7, "connection": "local", "ended": False}


def test_the_final_status_waits_for_a_superlink_that_answers_and_not_for_one_that_is_gone(tmp_path, monkeypatch):
    from fedhm_flwr.ops.job import flower_job

    monkeypatch.setattr(flower_job.time, "sleep", lambda s: None)
    job = _job(tmp_path)
    job.run_id = 5
    answers = iter(
        [
            {"success": True, "runs": [{"status": "running"}]},
            {"success": True, "runs": [{"status": "running"}]},
            {"success": True, "runs": [{"status": "finished:completed"}]},
        ]
    )
    job.cli = lambda *args, timeout=60: job.asked.append(args) or next(answers)
    assert job.status() == "finished:completed" and len(job.asked) == 3
    # the SuperLink stopped under the run: `flwr list` says so; asked once, not for the whole wait
    job.asked = []
    gone = {"success": False, "error-message": "Connection to the SuperLink is unavailable."}
    job.cli = lambda *args, timeout=60: job.asked.append(args) or gone
    assert job.status(wait=3600) is None and job.asked == [("list", "--run-id", "5")]
