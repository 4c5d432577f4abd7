"""Federated static-BN statistics equal the statistics computed centrally over the union."""

from __future__ import annotations

import json

import torch
from torch.utils.data import TensorDataset

from fedhm_flwr.math.bn_stats import apply_bn_statistics, bn_sums, combine_bn_sums, norm_layers, statistics
from fedhm_flwr.models import build_model
from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.server_app import run

SPEC = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 4}


def _clients(n=3, size=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [TensorDataset(torch.randn(size + 7 * i, 1, 28, 28, generator=g) * (1 + i), torch.zeros(size + 7 * i, dtype=torch.long))
            for i in range(n)]


def test_federated_statistics_equal_central_statistics_over_the_union():
    torch.manual_seed(0)
    model = build_model(SPEC)
    clients = _clients()
    fed = statistics(combine_bn_sums(bn_sums(model, ds, 16, torch.device("cpu")) for ds in clients))
    # central: record every norm layer's inputs over the union (same batches) and use torch's var
    seen = {name: [] for name in norm_layers(model)}
    hooks = [m.register_forward_pre_hook(lambda mod, inp, n=name: seen[n].append(inp[0].detach()))
             for name, m in norm_layers(model).items()]
    model.train()
    with torch.no_grad():
        for ds in clients:
            for i in range(0, len(ds), 16):
                x = ds.tensors[0][i:i + 16]
                if len(x) >= 2:
                    model(x)
    for h in hooks:
        h.remove()
    for name, chunks in seen.items():
        x = torch.cat([c.transpose(0, 1).reshape(c.shape[1], -1) for c in chunks], dim=1).double()
        mean, var = fed[name]
        assert torch.allclose(mean, x.mean(dim=1), atol=1e-9)
        assert torch.allclose(var, x.var(dim=1, unbiased=False), atol=1e-9)


def test_installed_statistics_are_what_eval_mode_normalises_with():
    torch.manual_seed(1)
    model = build_model(SPEC)
    sums = combine_bn_sums([bn_sums(model, ds, 16, torch.device("cpu")) for ds in _clients(2)])
    apply_bn_statistics(model, sums)
    bn = model.bn1
    mean, var = statistics(sums)["bn1"]
    x = torch.randn(5, bn.num_features, 6, 6)
    bn.eval()
    expected = (x - mean.float().view(1, -1, 1, 1)) / torch.sqrt(var.float().view(1, -1, 1, 1) + bn.eps)
    expected = expected * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
    assert torch.allclose(bn(x), expected, atol=1e-5)
    bn.train()
    assert not torch.allclose(bn(x), expected, atol=1e-3)  # training still uses batch statistics


def test_a_run_with_federated_statistics_asks_every_client(toy_cfg, tmp_path):
    cfg = toy_cfg("rounds=1 evaluation.bn_stats=federated levels.ratios=[1,0.25]")
    grid = LocalGrid(6, client_handlers())
    run(grid, cfg, tmp_path)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["bn_stats"] == "federated" and row["bytes_bn_stats"] > 0
    queries = [n for n, kind in grid.delivered if kind == "query"]
    assert len(queries) == 6 + 6 * 2  # node-info once, then bn-stats for the global and the 0.25 model
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bn_stats"] == "federated"
    assert summary["bytes_total"] == (summary["bytes_sent"] + summary["bytes_received"] + summary["bytes_bn_stats"]
                                     + summary["bytes_queries"])


def test_scaled_sub_model_statistics_describe_what_evaluation_sees():
    """HeteroFL's Scaler divides by the rate in training only: the statistics pass must not."""
    torch.manual_seed(2)
    model = build_model({**SPEC, "width_rate": 0.25, "scaler": True})
    x = _clients(1)[0].tensors[0][:16]
    sums = bn_sums(model, TensorDataset(x, torch.zeros(16, dtype=torch.long)), 16, torch.device("cpu"))
    seen = []
    hook = model.bn1.register_forward_pre_hook(lambda mod, inp: seen.append(inp[0].detach()))
    model.eval()
    with torch.no_grad():
        model(x)
    hook.remove()
    # bn1's input depends on no earlier norm, so one batch's statistics must equal eval's input mean
    assert torch.allclose(statistics(sums)["bn1"][0], seen[0].double().mean(dim=(0, 2, 3)), atol=1e-6)
