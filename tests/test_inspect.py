"""``inspect`` counts from shapes (meta device) exactly what the allocating path counts."""

from __future__ import annotations

import pytest
import torch

from fedhm_flwr.config import load_config, model_spec, run_options
from fedhm_flwr.ops.tools.cost_table import SHAPE_ONLY, _rows, level_rows
from fedhm_flwr.server.registry import STRATEGIES


def _allocating_rows(overrides: list[str]):
    """The previous path: real weights, real SVDs, payloads built from values."""
    cfg = load_config(overrides)
    spec = model_spec(cfg)
    opts = run_options(cfg)
    return _rows(opts, spec, STRATEGIES[opts.method.name](opts, spec).method)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=resnet18", "model.width=16", "dataset=cifar10"],
        ["method=heterofl"],
        ["method=fedrolex", "model=resnet18", "model.width=8", "dataset=cifar100"],
    ],
)
def test_meta_counts_equal_the_allocating_path(overrides, monkeypatch):
    import fedhm_flwr.math.lowrank as lowrank

    computed = []
    real = lowrank._gram_svd
    monkeypatch.setattr(lowrank, "_gram_svd", lambda *a, **k: computed.append(1) or real(*a, **k))
    cfg, rows = level_rows(overrides)
    assert cfg.method.name in SHAPE_ONLY and not computed  # no decomposition computed on the meta path
    assert rows == _allocating_rows(overrides)


def test_resnet34_cifar100_levels_match_table_2():
    with torch.device("cpu"):
        _, rows = level_rows(["model=resnet34", "dataset=cifar100"])
    assert [r["params"] for r in rows] == [21_328_292, 8_401_316, 4_985_252, 3_277_220]
    assert [round(r["params"] / 1e6, 2) for r in rows] == [21.33, 8.40, 4.99, 3.28]
    assert [r["payload_bytes"] for r in rows] == [4 * r["params"] for r in rows]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], []),  # the default levels all shrink the CNN
        (["levels.ratios=[1,0.999,0.125]"], ["level 0.999 is not smaller than the full model"]),
        (["model.factorize.include=['no_such_layer*']"], ["FedHM factorizes no layer of this model at any level"]),
        (["method=heterofl", "model.factorize.include=['no_such_layer*']"], []),  # FedHM's warning only
    ],
)
def test_the_server_warns_of_fedhm_levels_that_do_not_shrink_the_model(overrides, expected):
    """What the ServerApp prints before round 1 (``size_warnings``): one line per level below 1 whose
    model is not smaller than the full one, or one line when no layer is factorized; each names the
    full model's parameter count (counted here by torch) and the keys that change it."""
    from fedhm_flwr.models import build_model
    from fedhm_flwr.ops.tools.cost_table import size_warnings

    cfg = load_config(overrides)
    spec = model_spec(cfg)
    lines = size_warnings(run_options(cfg), spec)
    assert len(lines) == len(expected)
    full = sum(p.numel() for p in build_model(spec).parameters())
    for line, start in zip(lines, expected):
        assert line.startswith(start) and f"{full:,}" in line and "model.factorize" in line, line
