"""The launcher's ``flwr list --run-id`` and ``flwr stop`` answered in its own process
(fedhm_flwr/ops/job/control.py) against a real simulation SuperLink: the answer is the one the ``flwr``
command prints (run here as a process, the reference), with and without the in-process parts; the
console gets nothing from it."""

from __future__ import annotations

import json
import subprocess

from fedhm_flwr.ops.job import control
from fedhm_flwr.ops.job.flower_job import FlowerJob
from fedhm_flwr.ops.job.procs import Processes
from fedhm_flwr.ops.job.superlink import APP_DIR, SIMULATION_CONNECTION, bin_path, start_simulation_superlink

UNKNOWN_RUN = 4242


def _command(env: dict[str, str], *args: str) -> dict:
    out = subprocess.run(
        [bin_path("flwr"), *args, SIMULATION_CONNECTION, "--format", "json"],
        env=env,
        cwd=APP_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return json.loads(out[out.index("{") :])


def _same_refusal(inside: dict | None, reference: dict) -> None:
    """The command's refusal: ``success`` false, its message (after the lines the command printed first)."""
    assert inside is not None and inside.keys() == {"success", "error-message"}, inside
    assert inside["success"] is False and inside["error-message"], inside
    assert reference["error-message"].endswith(inside["error-message"]), (inside, reference)


def test_in_process_answers_are_the_commands_and_a_missing_part_falls_back_to_the_command(
    tmp_path, capsys, monkeypatch
):
    with Processes() as procs:
        env = start_simulation_superlink(procs, tmp_path / ".flwr", tmp_path / "superlink.log")
        job = FlowerJob(procs, env, SIMULATION_CONNECTION, tmp_path / "flwr_run.log", echo=False)
        for args in (("list", "--run-id", str(UNKNOWN_RUN)), ("stop", str(UNKNOWN_RUN))):
            reference = _command(env, *args)
            assert reference["success"] is False, reference  # the SuperLink refuses: no such run
            inside = control.ask(env, SIMULATION_CONNECTION, args[0], UNKNOWN_RUN)
            _same_refusal(inside, reference)
            assert job.cli(*args) == inside
        assert capsys.readouterr().out == ""  # Flower's "Using SuperLink: ..." line stays off the console

        # without the in-process parts (another Flower release), the command answers
        monkeypatch.setitem(control._STATE, "modules", {})
        assert control.ask(env, SIMULATION_CONNECTION, "list", UNKNOWN_RUN) is None
        reference = _command(env, "list", "--run-id", str(UNKNOWN_RUN))
        assert job.cli("list", "--run-id", str(UNKNOWN_RUN)) == reference

    # no SuperLink any more: the same refusal as the command's
    monkeypatch.undo()
    reference = _command(env, "list", "--run-id", str(UNKNOWN_RUN))
    assert reference["success"] is False
    _same_refusal(control.ask(env, SIMULATION_CONNECTION, "list", UNKNOWN_RUN), reference)
