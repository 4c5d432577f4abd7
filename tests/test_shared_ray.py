"""One Ray instance for a sweep's jobs (fedhm_flwr/ops/sweeps/shared_ray.py): when it is used, that the launcher
hands it to Flower, that it is stopped with the block, and that a job's results do not depend on it."""

from __future__ import annotations

import pytest

from fedhm_flwr.ops.job import launch
from fedhm_flwr.ops.sweeps import multirun, shared_ray
from fedhm_flwr.ops.sweeps.shared_ray import SHARED_RAY_VAR

TINY = [
    "rounds=2",
    "num_clients=4",
    "fraction_train=1.0",
    "dataset.max_train_examples=800",
    "dataset.max_test_examples=200",
    "model.width=4",
    "evaluation.deploy_stats=false",
]


@pytest.mark.parametrize("value, on", [("1", True), ("On", True), ("", False), ("0", False), ("false", False)])
def test_the_switch_reads_the_environment(value, on):
    assert shared_ray.enabled({shared_ray.SHARED_RAY_SWITCH: value} if value else {}) is on


@pytest.mark.parametrize(
    "env, overrides",
    [
        ({}, ["seed=0,1"]),
        ({shared_ray.SHARED_RAY_SWITCH: "0"}, ["seed=0,1"]),
        ({shared_ray.SHARED_RAY_SWITCH: "1", SHARED_RAY_VAR: "127.0.0.1:1"}, ["seed=0,1"]),
        ({shared_ray.SHARED_RAY_SWITCH: "1"}, ["seed=0,1", "simulation.ray_address=auto"]),
    ],
)
def test_a_sweep_starts_no_ray_instance_when_it_is_off_handed_down_or_configured(monkeypatch, env, overrides):
    monkeypatch.delenv(SHARED_RAY_VAR, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(multirun, "shared_ray", lambda: pytest.fail("a shared Ray instance was started"))
    with multirun.sweep_ray(overrides) as extra:
        assert extra == {}


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    "configured, shared, expected",
    [(None, None, None), (None, "10.0.0.1:6379", "10.0.0.1:6379"), ("auto", "10.0.0.1:6379", "auto")],
)
def test_the_launcher_gives_flower_the_configured_address_else_the_shared_one(
    monkeypatch, tmp_path, configured, shared, expected
):
    if shared:
        monkeypatch.setenv(SHARED_RAY_VAR, shared)
    else:
        monkeypatch.delenv(SHARED_RAY_VAR, raising=False)

    def superlink(procs, home, log, ray_address=None):
        raise _Stop(ray_address)

    monkeypatch.setattr(launch, "start_simulation_superlink", superlink)
    with pytest.raises(_Stop) as stop:
        launch.run_job(TINY + ([f"simulation.ray_address={configured}"] if configured else []), tmp_path / "run")
    assert stop.value.args[0] == expected
