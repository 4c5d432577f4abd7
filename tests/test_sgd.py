"""The local loop's SGD on a CPU (fedhm_flwr/math/sgd.py): torch.optim.SGD's updates bit for bit, and no
torch._dynamo import in a process that trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedhm_flwr.math.sgd import MomentumSGD, make_sgd

ROOT = Path(__file__).resolve().parents[1]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10), nn.Linear(10, 3)
    )


def _groups(net: nn.Module, weight_decay: float) -> list[dict]:
    params = list(net.parameters())
    return [{"params": params[:4], "weight_decay": weight_decay}, {"params": params[4:], "weight_decay": 0.0}]


@pytest.mark.parametrize(("lr", "momentum", "weight_decay"), [(0.05, 0.9, 5e-4), (0.1, 0.0, 1e-3), (0.01, 0.5, 0.0)])
def test_its_updates_are_torch_sgds_bit_for_bit(lr, momentum, weight_decay):
    ours, theirs = _net(), _net()
    ours.load_state_dict(theirs.state_dict())
    theirs[-1].weight.requires_grad_(False)  # a frozen parameter (no gradient), in both
    ours[-1].weight.requires_grad_(False)
    opt_ours = MomentumSGD(_groups(ours, weight_decay), lr, momentum)
    opt_theirs = torch.optim.SGD(_groups(theirs, weight_decay), lr=lr, momentum=momentum)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), y).backward()
            if step == 2:  # a parameter without a gradient this step keeps its value and its buffer
                net[0].weight.grad = None
            opt.step()
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
            assert torch.equal(a, b), (step, name, (a - b).abs().max())
    if momentum:
        assert len(opt_ours.buffers) == sum(p.requires_grad for p in ours.parameters())


def test_the_loop_takes_torchs_sgd_off_the_cpu_and_ours_on_it():
    net = _net()
    assert isinstance(make_sgd(_groups(net, 0.0), 0.1, 0.9, torch.device("cpu")), MomentumSGD)
    assert isinstance(make_sgd(_groups(net, 0.0), 0.1, 0.9, torch.device("meta")), torch.optim.SGD)
    with pytest.raises(ValueError, match="set_to_none"):
        MomentumSGD(_groups(net, 0.0), 0.1, 0.9).zero_grad(set_to_none=False)


def test_a_process_that_trains_on_the_cpu_does_not_import_torch_dynamo():
    """torch.optim's step and zero_grad import torch._dynamo (~1.5 s of CPU) in every process that
    trains with them: every client actor and every ClientApp process a SuperNode starts."""
    probe = """
import sys, torch
from torch.utils.data import TensorDataset
from fedhm_flwr.math.train import TrainOptions, train_local
from fedhm_flwr.config import load_config
from fedhm_flwr.config.specs import model_spec
from fedhm_flwr.models import build_model
model = build_model(model_spec(load_config("model.width=4")))
data = TensorDataset(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
out = train_local(model, data, TrainOptions.from_dict({"batch_size": 16, "frobenius_decay": True}), torch.device("cpu"))
print(len(out) > 0, "torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False"], done.stdout
