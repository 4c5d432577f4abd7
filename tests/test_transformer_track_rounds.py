"""Transformer track, rounds: FedLoRA and HeteroTune messages and merges, whole in-process runs and
`flwr run` launches. Models, data and what trains are in tests/test_transformer_track.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from transformer_helpers import HETERO, TINY_IMAGE, TINY_TEXT, build_strategy

from fedhm_flwr.config import load_config
from fedhm_flwr.math.aggregation import level_weights
from fedhm_flwr.math.cmga import default_scale
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import federated_keys, load_federated
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.server.strategy import Reply


def _configure(strategy, grid, state, rnd=1):
    return list(strategy.configure_train(rnd, ArrayRecord.from_torch_state_dict(state), None, grid))


# ------------------------------------------------------------------------------------ FedLoRA


def test_fedlora_messages_carry_only_factors_and_head_and_hand_out_the_truncation():
    strategy = build_strategy(f"method=fedlora {TINY_IMAGE} method.max_rank=4")
    assert strategy.method.ranks == [4, 2, 1, 1]
    state = strategy.method.initial_state(0)
    assert not set(state) & set(build_model(strategy.method.spec).local_keys)  # no backbone in the global state
    g = torch.Generator().manual_seed(0)
    for t in strategy.method.targets:  # a non-trivial ΔW of rank 3
        k = f"{t}.lora_delta"
        state[k] = torch.randn(state[k].shape[0], 3, generator=g) @ torch.randn(3, state[k].shape[1], generator=g)
    grid = LocalGrid(4, client_handlers())
    messages = _configure(strategy, grid, state)
    # every record travels and counts: the arrays and the training config
    assert strategy.round_log.sent_bytes == sum(r.count_bytes() for m in messages for r in m.content.values())
    for msg in messages:
        config = msg.content["config"]
        spec = json.loads(config["model-spec"])
        rank = strategy.method.ranks[config["level-index"]]
        got = msg.content["arrays"].to_torch_state_dict()
        assert spec["trainable_only"] and spec["lora"] == {"rank": rank}
        assert set(got) == set(federated_keys(build_model(spec)))
        t = strategy.method.targets[0]
        delta = state[f"{t}.lora_delta"].double()
        S = torch.linalg.svdvals(delta)
        err = delta - got[f"{t}.lora_B"].double() @ got[f"{t}.lora_A"].double()
        assert float(torch.linalg.norm(err)) == pytest.approx(float(S[rank:].pow(2).sum().sqrt()), abs=1e-4)


def test_fedlora_merge_is_the_fedhm_weighted_sum_of_products():
    strategy = build_strategy(f"method=fedlora {TINY_IMAGE} method.max_rank=4")
    state = strategy.method.initial_state(0)
    g = torch.Generator().manual_seed(1)
    replies = []
    for i in (0, 1, 3):
        _, payload, _ = strategy.method.level_payload(i, state)
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in payload.items()}
        counts = np.array([5] * 10)
        replies.append(Reply(i, i, strategy.levels[i], trained, 50, counts, {}))
    new = strategy.method.merge(1, state, replies)
    w = level_weights([r.level for r in replies], 1.0)
    t = strategy.method.targets[-1]
    want = sum(wi * r.state[f"{t}.lora_B"].double() @ r.state[f"{t}.lora_A"].double() for wi, r in zip(w, replies))
    assert torch.allclose(new[f"{t}.lora_delta"].double(), want, atol=1e-5)
    assert torch.allclose(
        new["head.bias"].double(), sum(wi * r.state["head.bias"].double() for wi, r in zip(w, replies)), atol=1e-6
    )
    assert set(new) == set(state)


# ------------------------------------------------------------------------------------ HeteroTune


@pytest.mark.parametrize("track", ["text", "image"])
def test_heterotune_deployable_model_equals_the_trained_dema_model(track):
    """The server's exact merge: the deployable type-i model (bank merged into plain adapters)
    computes what the type-i training model computes."""
    base = TINY_TEXT if track == "text" else TINY_IMAGE
    strategy = build_strategy(f"method=heterotune {base} {HETERO}")
    state = strategy.method.initial_state(0)
    g = torch.Generator().manual_seed(2)
    state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in state.items()}  # non-trivial everything
    x = torch.randint(1000, 2000, (4, 10)) if track == "text" else torch.randn(4, 1, 28, 28)
    for i in range(2):
        spec, payload, _ = strategy.method.level_payload(i, state)
        trained = build_model(spec)
        load_federated(trained, payload)
        dspec, dstate = strategy.method.deployable(i, state)
        deployed = build_model(dspec)
        load_federated(deployed, dstate)
        with torch.no_grad():
            assert torch.allclose(deployed.eval()(x), trained.eval()(x), atol=1e-4, rtol=1e-4)
        assert not any(".share_" in k or ".gate_" in k for k in dstate)


def test_heterotune_merge_averages_within_types_and_aligns_share_updates_with_cmga():
    strategy = build_strategy(f"method=heterotune {TINY_IMAGE} {HETERO}")
    state = strategy.method.initial_state(0)
    g = torch.Generator().manual_seed(3)
    replies = []
    for node, i in enumerate((0, 0, 1)):
        spec, payload, _ = strategy.method.level_payload(i, state)
        keys = strategy.method.reply_keys(i, spec, payload)
        replies.append(
            Reply(
                node,
                i,
                strategy.levels[i],
                {k: payload[k] + torch.randn(payload[k].shape, generator=g) for k in keys},
                10 * (node + 1),
                np.ones(10, int),
                {},
            )
        )
    new = strategy.method.merge(1, state, replies)
    # local adapters: sample-weighted mean within type 0 (nodes 0 and 1: weights 1/3, 2/3)
    key = "adapters.0.down.weight"
    want = (replies[0].state[key] + 2 * replies[1].state[key]) / 3
    assert torch.allclose(new["type0." + key], want, atol=1e-6)
    assert torch.equal(new["type1." + key], replies[2].state[key])
    # share-adapters of slot 0: the two types' updates, aligned: orthogonal, equal length, norm kept
    deltas, aligned = [], []
    for i in (0, 1):
        keys = [f"adapters.0.share_{s}.{i}" for s in ("pre", "post")]
        if i == 0:
            mean = [(replies[0].state[k].double() + 2 * replies[1].state[k].double()) / 3 for k in keys]
        else:
            mean = [replies[2].state[k].double() for k in keys]
        deltas.append(torch.cat([(m - state[k].double()).flatten() for m, k in zip(mean, keys)]))
        aligned.append(torch.cat([(new[k].double() - state[k].double()).flatten() for k in keys]))
    G, Gt = torch.stack(deltas, 1), torch.stack(aligned, 1)
    c = default_scale(G)
    assert torch.allclose(Gt.T @ Gt, c**2 * torch.eye(2, dtype=torch.float64), rtol=1e-4, atol=1e-4 * c**2)
    assert float(torch.linalg.norm(Gt)) == pytest.approx(float(torch.linalg.norm(G)), rel=1e-4)
    # without CMGA: S_i <- S_i + Δ_i
    plain = build_strategy(f"method=heterotune method.cmga=false {TINY_IMAGE} {HETERO}")
    new2 = plain.method.merge(1, state, replies)
    k = "adapters.0.share_pre.1"
    assert torch.allclose(new2[k], replies[2].state[k], atol=1e-6)


def test_heterotune_types_by_depth_share_slots_only_where_they_exist():
    strategy = build_strategy(f"method=heterotune {TINY_TEXT} {HETERO}")
    assert strategy.method.depths == [2, 1] and strategy.method.members == [[0, 1], [0]]
    state = strategy.method.initial_state(0)
    _, small, _ = strategy.method.level_payload(1, state)
    assert {k for k in small if ".share_" in k} == {
        f"adapters.0.share_{s}.{j}" for s in ("pre", "post") for j in (0, 1)
    }
    costs = [strategy.method.level_cost(i) for i in range(2)]
    assert costs[0]["params"] > costs[1]["params"] and costs[1]["bytes_down"] > costs[1]["bytes_up"]
    vit = build_strategy(f"method=heterotune {TINY_IMAGE} {HETERO}")  # ViT: types by width (auto)
    assert vit.method.depths == [2, 2] and [s["width"] for s in vit.method.type_specs] == [16, 8]
    vit = build_strategy(f"method=heterotune {TINY_IMAGE} {HETERO} method.scale=depth")
    assert vit.method.depths == [2, 1] and [s["width"] for s in vit.method.type_specs] == [16, 16]


# ------------------------------------------------------------------------------------ whole runs


@pytest.mark.parametrize("method", ["fedlora", "heterotune"])
def test_in_process_round_of_each_method_is_valid_and_moves_only_adapters(method, tmp_path):
    extra = HETERO if method == "heterotune" else "method.max_rank=4"
    cfg = load_config(f"method={method} {TINY_TEXT} {extra}")
    summary = run(LocalGrid(4, client_handlers()), cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 4 and rows[-1]["rejected"] == 0 and rows[-1]["failures"] == 0
    costs = summary["level_costs"]
    assert all(0 < c["bytes_up"] < 1e6 for c in costs.values())  # no frozen backbone (~4 MB here) travels
    for level in cfg.levels.ratios:
        assert 0 <= summary[f"final_acc/level_{level:g}"] <= 1


# ------------------------------------------------------------------------------------ flwr run


@pytest.mark.slow
def test_flwr_run_finishes_for_both_methods_on_both_tracks(tmp_path):
    """FedLoRA on the text track and HeteroTune on the image track (both methods, both tracks), each a
    2-round launch through `flwr run`. The two launches run side by side (each has its own SuperLink
    on free ports and its own Ray instance): a launch is mostly Flower's start-up, waiting (~20 s each
    here), so together they take little more than one."""
    jobs = {("fedlora", "text"): (TINY_TEXT, "method.max_rank=4"), ("heterotune", "image"): (TINY_IMAGE, HETERO)}
    procs = {}
    for (method, track), (base, extra) in jobs.items():
        out = tmp_path / f"{method}-{track}"
        cmd = [
            sys.executable,
            "-m",
            "fedhm_flwr.ops.job.launch",
            f"method={method}",
            *base.split(),
            *extra.split(),
            "rounds=2",
            "--run-dir",
            str(out),
        ]
        console = tmp_path / f"{method}-{track}.console"
        with console.open("wb") as sink:  # a file, not a pipe: neither launch waits for its output to be read
            procs[method, track] = (out, console, subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT))
    try:
        for (method, track), (out, console, proc) in procs.items():
            proc.wait(timeout=900)
            assert proc.returncode == 0, (method, track, console.read_text(errors="replace")[-6000:])
            summary = json.loads((out / "summary.json").read_text())
            assert summary["rounds_completed"] == 2 and math.isfinite(summary["final_acc/global"]), (method, track)
    finally:
        for _, _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
