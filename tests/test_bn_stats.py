"""Federated static-BN statistics equal the statistics computed centrally over the union."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import torch
from flwr.app import ArrayRecord, MessageType, RecordDict
from torch.utils.data import TensorDataset

from fedhm_flwr.client import handlers as client
from fedhm_flwr.core import bn_wire, protocol as wire
from fedhm_flwr.data import client_dataset
from fedhm_flwr.math.bn_stats import apply_bn_statistics, bn_sums, combine_bn_sums, norm_layers, statistics
from fedhm_flwr.models import build_model
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.reporting.results import load_bn_statistics
from fedhm_flwr.server.reply_arrays import check_bn_reply

SPEC = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 4}


def _clients(n=3, size=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        TensorDataset(
            torch.randn(size + 7 * i, 1, 28, 28, generator=g) * (1 + i), torch.zeros(size + 7 * i, dtype=torch.long)
        )
        for i in range(n)
    ]


def test_federated_statistics_equal_central_statistics_over_the_union():
    torch.manual_seed(0)
    model = build_model(SPEC)
    clients = _clients()
    fed = statistics(combine_bn_sums(bn_sums(model, ds, 16, torch.device("cpu")) for ds in clients))
    # central: record every norm layer's inputs over the union (same batches) and use torch's var
    seen = {name: [] for name in norm_layers(model)}
    hooks = [
        m.register_forward_pre_hook(lambda mod, inp, n=name: seen[n].append(inp[0].detach()))
        for name, m in norm_layers(model).items()
    ]
    model.train()
    with torch.no_grad():
        for ds in clients:
            for i in range(0, len(ds), 16):
                x = ds.tensors[0][i : i + 16]
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
    assert len(queries) == 6 + 6  # node-info once, then one bn-stats for the global and the 0.25 model together
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bn_stats"] == "federated"
    assert summary["bytes_total"] == (
        summary["bytes_sent"] + summary["bytes_received"] + summary["bytes_bn_stats"] + summary["bytes_queries"]
    )


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


# ---------------------------------------------------------------------- every level in one query


def _bn_queries(tamper=None):
    """The project's handlers with the bn-stats queries recorded as (node id, message, context);
    ``tamper(node_id, reply content)`` may change a reply before it goes back."""
    handlers, seen = client_handlers(), []
    real = handlers[MessageType.QUERY]

    def query(msg, context):
        reply = real(msg, context)
        if str(msg.content[wire.CONFIG][wire.QUERY]) == wire.BN_STATS:
            seen.append((msg.metadata.dst_node_id, msg, context))
            if tamper is not None:
                tamper(msg.metadata.dst_node_id, reply.content)
        return reply

    handlers[MessageType.QUERY] = query
    return handlers, seen


def _direct_sums(queries, cfg):
    """Per model asked and per node: the sums of that model (its spec and arrays as sent) over the
    node's training partition, computed here with bn_sums (no query), as a node sends them (float32)."""
    out = []
    for _, msg, context in queries:
        specs = [json.loads(s) for s in msg.content[wire.CONFIG][wire.MODEL_SPECS]]
        data = json.loads(str(msg.content[wire.CONFIG][wire.DATA_SPEC]))
        dataset = client_dataset({**data, "augment": False}, int(context.node_config[wire.PARTITION_ID]), None, "train")
        per_model = []
        for i, spec in enumerate(specs):
            model = client.load_model(
                spec, msg.content[bn_wire.bn_record(i)].to_torch_state_dict(), torch.device("cpu")
            )
            per_model.append(
                {
                    k: v.float()
                    for k, v in bn_sums(model, dataset, int(cfg.train.batch_size), torch.device("cpu")).items()
                }
            )
        out.append(per_model)
    return out


# every example of a node (bn_examples=0), so that the sums can be recomputed over its whole partition
LEVELS4 = "rounds=1 levels.ratios=[1,0.5,0.25,0.125] evaluation.bn_clients=4 evaluation.bn_examples=0"


def test_deployment_statistics_of_every_level_travel_in_one_message_per_node(toy_cfg, tmp_path):
    """A 4-level run's deployment statistics: one bn-stats message per node asked (4 of 6), each
    carrying the 4 levels' models, and the saved statistics are, bit for bit, each level's sums
    over the asked nodes' training data computed directly."""
    cfg = toy_cfg(LEVELS4)
    handlers, seen = _bn_queries()
    grid = LocalGrid(6, handlers)
    run(grid, cfg, tmp_path)
    nodes = [node for node, _, _ in seen]
    assert len(nodes) == 4 and len(set(nodes)) == 4  # one message per node asked, not one per level
    assert sum(1 for _, kind in grid.delivered if kind == MessageType.QUERY) == 6 + 4  # node-info, then bn-stats
    for _, msg, _ in seen:
        assert len(msg.content[wire.CONFIG][wire.MODEL_SPECS]) == 4
        assert {bn_wire.bn_record(i) for i in range(4)} <= set(msg.content)
    tensors, meta = load_bn_statistics(tmp_path)
    assert meta["nodes_asked"] == "4"
    direct = _direct_sums(seen, cfg)
    expected = {}
    for i, level in enumerate((1, 0.5, 0.25, 0.125)):
        sums = combine_bn_sums(per_model[i] for per_model in direct)
        expected.update({f"level_{level:g}/{k}": v for k, v in sums.items()})
    assert tensors.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key
    # the levels differ (the statistics of four different models, not one model four times)
    small = [k.split("/", 1)[1] for k in tensors if k.startswith("level_0.125/") and k.endswith(".sum")]
    assert any(not torch.equal(tensors[f"level_1/{k}"], tensors[f"level_0.125/{k}"]) for k in small)


def test_a_reply_missing_a_level_or_misshapen_is_refused_for_that_node_only(toy_cfg, tmp_path, caplog):
    """One node's reply lacks a level, another's holds a sum of the wrong shape: both are refused
    with a warning naming the node, and the statistics are the other two nodes' sums."""
    cfg = toy_cfg(LEVELS4)
    asked: list[int] = []

    def tamper(node_id, content):
        asked.append(node_id)
        if len(asked) == 1:
            del content[bn_wire.bn_record(2)]
        elif len(asked) == 3:
            record = content[bn_wire.bn_record(0)]
            record["bn1.sum"] = ArrayRecord.from_torch_state_dict({"x": torch.zeros(3)})["x"]

    handlers, seen = _bn_queries(tamper)
    with caplog.at_level(logging.WARNING):
        run(LocalGrid(6, handlers), cfg, tmp_path)
    warned = [r.getMessage() for r in caplog.records if "bn-stats: node" in r.getMessage()]
    assert len(warned) == 2, warned
    label = {node: f"p{context.node_config[wire.PARTITION_ID]}" for node, _, context in seen}
    first, third = label[asked[0]], label[asked[2]]  # (replies are pulled in no fixed order)
    assert any(f"node {first} " in w and "missing ['arrays.2']" in w for w in warned), warned
    assert any(f"node {third} " in w and "bn1.sum" in w and "(3,)" in w for w in warned), warned
    tensors, _ = load_bn_statistics(tmp_path)
    direct = _direct_sums(seen, cfg)
    kept = [direct[1], direct[3]]  # the first and third node's replies were refused
    for i, level in enumerate((1, 0.5, 0.25, 0.125)):
        sums = combine_bn_sums(per_model[i] for per_model in kept)
        for key, value in sums.items():
            assert torch.equal(tensors[f"level_{level:g}/{key}"], value), (level, key)


def _reply(*records: dict[str, torch.Tensor]) -> RecordDict:
    return RecordDict({bn_wire.bn_record(i): ArrayRecord.from_torch_state_dict(r) for i, r in enumerate(records)})


SHAPES = bn_wire.bn_sum_shapes({"bn1": 3, "bn2": 2})
GOOD = {
    "bn1.sum": torch.ones(3),
    "bn1.sumsq": torch.ones(3),
    "bn1.count": torch.tensor(5.0),
    "bn2.sum": torch.ones(2),
    "bn2.sumsq": torch.ones(2),
    "bn2.count": torch.tensor(5.0),
}


def test_bn_reply_check_takes_whole_models_and_refuses_anything_else():
    sums, why = check_bn_reply(_reply(GOOD, {}), [SHAPES, SHAPES])  # an empty record: no training data
    assert why == "" and sums is not None and sums[1] == {}
    assert all(torch.equal(sums[0][k], v) for k, v in GOOD.items())
    bad = {
        "a model missing": (_reply(GOOD), "missing ['arrays.1']"),
        "an extra record": (_reply(GOOD, GOOD, GOOD), "unexpected ['arrays.2']"),
        "a layer without its count": (
            _reply(GOOD, {k: v for k, v in GOOD.items() if k != "bn2.count"}),
            "lacks ['bn2.count']",
        ),
        "a key of no layer": (_reply(GOOD, {**GOOD, "fc.sum": torch.ones(2)}), "no norm layer"),
        "a wrong shape": (_reply(GOOD, {**GOOD, "bn1.sumsq": torch.ones(4)}), "bn1.sumsq"),
        "a count that is not a scalar": (_reply(GOOD, {**GOOD, "bn2.count": torch.ones(1)}), "bn2.count"),
        "an integer array": (_reply(GOOD, {**GOOD, "bn2.sum": torch.ones(2, dtype=torch.int64)}), "int64"),
    }
    lying = _reply(GOOD, GOOD)  # the record says shape (2,), the bytes hold 3 values
    lying[bn_wire.bn_record(1)]["bn2.sum"] = dataclasses.replace(
        ArrayRecord.from_torch_state_dict({"x": torch.ones(3)})["x"], shape=(2,)
    )
    bad["bytes of another shape"] = (lying, "bytes declare float32 of shape (3,)")
    garbage = _reply(GOOD, GOOD)
    garbage[bn_wire.bn_record(1)]["bn2.sum"] = dataclasses.replace(garbage[bn_wire.bn_record(1)]["bn2.sum"], data=b"xx")
    bad["bytes that are no array"] = (garbage, "holds 2 bytes")
    bad["a NaN sum"] = (_reply(GOOD, {**GOOD, "bn2.sum": torch.tensor([1.0, float("nan")])}), "NaN")
    bad["a negative count"] = (_reply(GOOD, {**GOOD, "bn1.count": torch.tensor(-5.0)}), "negative")
    bad["a float64 array"] = (_reply(GOOD, {**GOOD, "bn1.sum": torch.ones(3, dtype=torch.float64)}), "float64")
    for case, (content, reason) in bad.items():
        sums, why = check_bn_reply(content, [SHAPES, SHAPES])
        assert sums is None and reason in why, (case, why)


def test_a_node_sums_statistics_over_a_seeded_subset_of_at_most_bn_examples(toy_cfg, tmp_path):
    """``evaluation.bn_examples=K``: each node asked sums its norm statistics over K of its training
    examples, the sorted draw ``default_rng(seed).choice(n, K, replace=False)`` with the seed its
    query carries (a different one per node), bit for bit as summed directly over those examples."""
    cfg = toy_cfg("rounds=1 levels.ratios=[1,0.25] evaluation.bn_examples=40")
    handlers, seen = _bn_queries()
    run(LocalGrid(6, handlers), cfg, tmp_path)
    tensors, _ = load_bn_statistics(tmp_path)
    assert len(seen) == 6 and len({int(msg.content[wire.CONFIG][wire.SEED]) for _, msg, _ in seen}) == 6
    parts = []
    for _, msg, context in seen:
        config = msg.content[wire.CONFIG]
        assert int(config[wire.BN_EXAMPLES]) == 40
        data = json.loads(str(config[wire.DATA_SPEC]))
        dataset = client_dataset({**data, "augment": False}, int(context.node_config[wire.PARTITION_ID]), None, "train")
        assert len(dataset) > 40
        picked = np.sort(np.random.default_rng(int(config[wire.SEED])).choice(len(dataset), 40, replace=False))
        subset = torch.utils.data.Subset(dataset, picked.tolist())
        spec = json.loads(config[wire.MODEL_SPECS][0])
        model = client.load_model(spec, msg.content[bn_wire.bn_record(0)].to_torch_state_dict(), torch.device("cpu"))
        parts.append(
            {k: v.float() for k, v in bn_sums(model, subset, int(cfg.train.batch_size), torch.device("cpu")).items()}
        )
    expected = combine_bn_sums(parts)
    first = next(k for k in expected if k.endswith(".count"))
    assert float(expected[first]) == 6 * 40 * 28 * 28  # 40 images a node, every pixel of the first layer's input
    for key, value in expected.items():
        assert torch.equal(tensors[f"level_1/{key}"], value), key
