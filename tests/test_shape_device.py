"""Counting a model from its shapes (fedhm_flwr.models.shape_device): a small model is counted on the CPU,
where a ServerApp's set-up imports no torch._dynamo (a meta-device forward imports it, about 2 s of CPU in
every ServerApp process), with the same counts as on the meta device and torch's global generator left as
it was (a seeded run draws what it drew when the counting ran on the meta device)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from data_helpers import REPO

import fedhm_flwr.models as models
from fedhm_flwr.config import load_config
from fedhm_flwr.config.specs import model_spec
from fedhm_flwr.models import build_model, matching as m, shape_device

GAMMAS = [1.0, 0.5, 0.25, 0.125]


def _clear() -> None:
    models._shape_device.cache_clear()
    m._counted_cost.cache_clear()


@pytest.fixture
def cnn_spec():
    _clear()
    yield model_spec(load_config([]))
    _clear()


def test_the_default_cnn_is_counted_on_the_cpu_and_a_large_model_on_the_meta_device(cnn_spec, monkeypatch):
    with shape_device(cnn_spec) as device:
        assert device.type == "cpu" and next(build_model(cnn_spec, spectral_init=False).parameters()).is_cpu
    monkeypatch.setattr(models, "SHAPES_ON_CPU_UP_TO", 1000)  # the CNN counts as large: the meta device
    _clear()
    with shape_device(cnn_spec) as device:
        assert device.type == "meta" and next(build_model(cnn_spec, spectral_init=False).parameters()).is_meta


def test_every_cost_counted_on_the_cpu_is_the_meta_devices(cnn_spec, monkeypatch):
    cpu = {r: m.fedhm_level_costs(cnn_spec, GAMMAS, None, r) for r in m.RESOURCES}
    monkeypatch.setattr(models, "SHAPES_ON_CPU_UP_TO", -1)
    _clear()
    meta = {r: m.fedhm_level_costs(cnn_spec, GAMMAS, None, r) for r in m.RESOURCES}
    assert cpu == meta
    assert cpu["params"][0] > cpu["params"][-1] > 0 and cpu["macs"][0] > cpu["macs"][-1] > 0


def test_counting_on_the_cpu_leaves_the_global_generator_as_it_was(cnn_spec):
    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    with shape_device(cnn_spec) as device:
        build_model(cnn_spec, spectral_init=False)  # initialised with draws from the global generator
        build_model({**cnn_spec, "width": 8}, spectral_init=False)
    assert device.type == "cpu"
    assert torch.equal(torch.rand(8), expected)


def test_a_servers_set_up_of_the_default_job_imports_no_torch_dynamo():
    """The strategy, its level costs and the size warnings of the default job, in a fresh process."""
    probe = """
import sys
from fedhm_flwr.config import load_config
from fedhm_flwr.config.options import run_options
from fedhm_flwr.config.specs import model_spec
from fedhm_flwr.ops.tools.cost_table import size_warnings
from fedhm_flwr.server.registry import METHODS
cfg = load_config([])
opts, spec = run_options(cfg), model_spec(cfg)
method = METHODS[opts.method.name](opts, spec)
costs = [method.level_cost(i) for i in range(len(opts.levels.ratios))]
print(size_warnings(opts, spec), costs[0]["macs"] > costs[-1]["macs"] > 0, "torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "True", "False"], done.stdout
