"""Figures 1 and 2: FedHM's server round against FedAvg's and against its independent floor
(:mod:`bench.floors`), the server's share of a round, and the bytes each level's client gets."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import echo, identity_query, spread, timed
from fedhm_flwr.config import load_config, model_spec, run_options
from fedhm_flwr.core.protocol import ARRAYS, CONFIG, LEVEL, LEVEL_INDEX

# ------------------------------------------------------------------------------------ figure 1


#: FedHM's server round ÷ its independent floor must stay under this (issue 25)
ROUND_OVER_FLOOR_TARGET = {"resnet18": 1.5, "cnn": 2.0}


def figure_server_time(quick: bool) -> dict[str, Any]:
    """configure_train + aggregate_train of FedHM vs FedAvg(full) with echoing clients."""
    from flwr.app import ArrayRecord, MessageType

    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import initial_state, run
    from fedhm_flwr.server.registry import STRATEGIES

    replies_n = 10
    repeats = 2 if quick else 5
    out: dict[str, Any] = {"replies": replies_n, "models": {}}
    models = [("cnn", 16)] + ([] if quick else [("resnet18", 64)])
    for arch, width in models:
        dataset = "cifar10" if arch.startswith("resnet") else "fashion_mnist"
        repeats = min(repeats, 3) if arch.startswith("resnet") else repeats  # seconds per SVD round
        row: dict[str, Any] = {}
        for method in ("fedhm", "fedavg"):
            extra = "method.variant=full" if method == "fedavg" else ""
            cfg = load_config(
                f"method={method} {extra} model={arch} model.width={width} dataset={dataset} "
                f"num_clients={replies_n} fraction_train=1.0"
            )
            spec = model_spec(cfg)
            strategy = STRATEGIES[method](run_options(cfg), spec)
            grid = LocalGrid(replies_n, {MessageType.TRAIN: echo, MessageType.QUERY: identity_query})
            state = initial_state(cfg.seed, spec)
            arrays = ArrayRecord.from_torch_state_dict(state)
            held: dict[str, Any] = {}
            configure = partial(_configure, held, iter(range(1, 10_000)), strategy, arrays, grid)
            aggregate = partial(_aggregate, held, strategy)
            configure()
            held["replies"] = grid.send_and_receive(held["msgs"])
            t_conf = timed(configure, repeats, warmup=0)
            held["replies"] = grid.send_and_receive(held["msgs"])
            t_agg = timed(aggregate, repeats, warmup=0)
            pieces: dict[str, Any] = {"configure_train": t_conf, "aggregate_train": t_agg}
            if method == "fedhm":  # chained rounds: each hands out a new model version (no cache hit)
                # (CNN rounds are ms: 90 of them for a steady median, each round paired with its floor)
                chain = repeats if arch.startswith("resnet") else 90
                pieces = fedhm_round_against_floor(strategy, grid, state, chain)
                # and at one thread, timed by the thread's CPU time: on a shared machine the wall
                # clock of 2 OpenMP threads waits on other processes (an eigh of 96 × 96 took 0.3 ms
                # at one thread and 20–40 ms at two, the cores busy), the floor's and the round's alike
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    row["fedhm_1thread"] = fedhm_round_against_floor(strategy, grid, state, 2 * chain, time.thread_time)
                finally:
                    torch.set_num_threads(threads)
            row[method] = pieces
        row["fedhm_over_floor"] = row["fedhm"]["round / floor"]["median_s"]
        row["fedhm_over_floor_1thread"] = row["fedhm_1thread"]["round / floor"]["median_s"]
        row["threads"] = torch.get_num_threads()
        row["floor_target"] = ROUND_OVER_FLOOR_TARGET[arch]
        row["fedhm_over_fedavg"] = (
            row["fedhm"]["configure_train"]["median_s"] + row["fedhm"]["aggregate_train"]["median_s"]
        ) / (row["fedavg"]["configure_train"]["median_s"] + row["fedavg"]["aggregate_train"]["median_s"])
        out["models"][f"{arch}-w{width}"] = row
    # the server's share of a real round's wall time (in-process round with training, CNN)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            "rounds=2 num_clients=10 fraction_train=1.0 dataset.max_train_examples=6000 "
            "dataset.max_test_examples=2000 evaluation.levels=false"
        )
        run(LocalGrid(10, client_handlers()), cfg, Path(tmp))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    out["round_share"] = {
        "model": "cnn-w16",
        "clients": 10,
        "round_seconds": last["seconds"],
        "server_seconds": last["server_seconds"],
        "eval_seconds": last.get("eval_seconds", 0.0),
        "server_share": last["server_seconds"] / last["seconds"],
        "note": "in-process grid: clients train one after another in the server process",
    }
    return out


def _configure(held: dict[str, Any], counter: Iterator[int], strategy: Any, arrays: Any, grid: Any) -> None:
    """The next round's ``configure_train`` (its messages kept in ``held`` for the replies)."""
    held["round"] = next(counter)
    held["msgs"] = list(strategy.configure_train(held["round"], arrays, None, grid))


def _aggregate(held: dict[str, Any], strategy: Any) -> None:
    """``aggregate_train`` of the round ``held`` configured, on the replies it holds."""
    strategy.aggregate_train(held["round"], held["replies"])


def fedhm_round_against_floor(
    strategy: Any, grid: Any, state: dict[str, Any], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """FedHM's server work of whole rounds against an independent floor, measured in the same process.

    A round (medians over ``repeats`` chained rounds, the first one not counted): ``configure_train``
    + ``aggregate_train`` + the evaluation's share of the factorization (every level's deployable
    model of the merged state, as ``evaluate_levels`` asks for it; the evaluation itself is not
    counted). Each round hands out a new model version (the echoed replies are recovered from
    factors), so each pays its one decomposition per layer, wherever the cache puts it.

    The floor (:mod:`bench.floors`, plain torch, nothing imported from the project): one float32
    ``eigh`` of the smaller Gram matrix per factorizable layer of the merged state
    (:func:`bench.floors.decomposition_floor`) plus one weighted average of the replies by stacked
    factor products (:func:`bench.floors.average_floor`), each timed bare on the replies Flower
    deserialised, next to the round it is compared with (the machine is shared): right after it in
    one round, right before it in the next (then on the previous round's merged state and replies,
    the same sizes), since whichever runs second finds the other's data and code in the caches
    (the floor always after the round gave the lower ratio).
    ``clock``: the wall clock, or ``time.thread_time`` (the thread's CPU time: all of a round at one
    torch thread).
    """
    from flwr.app import ArrayRecord

    from bench import floors

    arrays = ArrayRecord.from_torch_state_dict(state)
    names = strategy.method.factorized
    cut = [max(strategy.method.layer_ranks[name]) for name in names]
    keys = (
        "configure_train",
        "aggregate_train",
        "evaluation's factorization",
        "server_round",
        "floor: float32 eigh of the Gram, one per layer",
        "floor: weighted average",
        "floor",
        "round / floor",
    )
    parts: dict[str, list[float]] = {key: [] for key in keys}

    def floor_of(merged: dict[str, Any], replies: list[Any]) -> tuple[float, float]:
        t0 = clock()
        floors.decomposition_floor([merged[f"{name}.weight"] for name in names], cut)
        t1 = clock()
        hybrid = [m.content[ARRAYS].to_torch_state_dict() for m in replies]
        weights = [1.0 / len(hybrid)] * len(hybrid)
        t2 = clock()
        floors.average_floor(merged, hybrid, weights)
        return t1 - t0, clock() - t2

    previous = None
    for k in range(repeats + 1):  # the round and its floor alternate, so that both see the same machine
        floor_first = k % 2 == 0 and previous is not None  # (and which goes first alternates too)
        if floor_first:
            decomposition, average = floor_of(*previous)
        t0 = clock()
        msgs = list(strategy.configure_train(10_000 + k, arrays, None, grid))
        t1 = clock()
        replies = grid.send_and_receive(msgs)
        t2 = clock()
        arrays, _ = strategy.aggregate_train(10_000 + k, replies)
        t3 = clock()
        merged = strategy.wire.state_of(arrays)  # as the evaluation gets it
        for index in range(len(strategy.levels)):
            strategy.method.deployable(index, merged)
        t4 = clock()
        if not floor_first:
            decomposition, average = floor_of(merged, replies)
        previous = (merged, replies)
        if k:  # the first round is a warm-up
            server, floor = (t1 - t0) + (t4 - t2), decomposition + average
            for key, value in zip(
                keys, (t1 - t0, t3 - t2, t4 - t3, server, decomposition, average, floor, server / floor)
            ):
                parts[key].append(value)
    out: dict[str, Any] = {key: spread(v) for key, v in parts.items()}
    out["clock"] = "thread CPU time" if clock is time.thread_time else "wall clock"
    out["floor_code"] = [floors.where(floors.decomposition_floor), floors.where(floors.average_floor)]
    return out


# ------------------------------------------------------------------------------------ figure 2


def serialized_bytes(msg: Any) -> int:
    """Bytes of a message as Flower ships it: the message and all its nested objects, deflated."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


def figure_bytes(quick: bool) -> dict[str, Any]:
    from flwr.app import ArrayRecord, MessageType

    from fedhm_flwr.ops.apps.local_grid import LocalGrid
    from fedhm_flwr.ops.apps.server_app import initial_state
    from fedhm_flwr.server.registry import STRATEGIES

    out = {}
    for arch, width, dataset in [("cnn", 16, "fashion_mnist")] + ([] if quick else [("resnet18", 64, "cifar10")]):
        cfg = load_config(f"model={arch} model.width={width} dataset={dataset} num_clients=8 fraction_train=1.0")
        spec = model_spec(cfg)
        strategy = STRATEGIES["fedhm"](run_options(cfg), spec)
        grid = LocalGrid(8, {MessageType.QUERY: identity_query})
        msgs = list(
            strategy.configure_train(1, ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, spec)), None, grid)
        )
        rows = {}
        for msg in msgs:
            level = float(msg.content[CONFIG][LEVEL])
            if level in rows:
                continue
            index = int(msg.content[CONFIG][LEVEL_INDEX])
            rows[level] = {
                "serialized_bytes": serialized_bytes(msg),
                "array_bytes": msg.content[ARRAYS].count_bytes(),
                "params": int(strategy.method.level_cost(index)["params"]),
            }
        full = rows[max(rows)]
        for r in rows.values():
            r["bytes_ratio"] = r["serialized_bytes"] / full["serialized_bytes"]
            r["params_ratio"] = r["params"] / full["params"]
        out[f"{arch}-w{width}"] = {f"{k:g}": v for k, v in sorted(rows.items(), reverse=True)}
    return out


def server_time_markdown(f1: dict[str, Any]) -> list[str]:
    """Figure 1's section of the report."""
    L: list[str] = []
    L += [
        "## 1. Server time per round (10 replies, medians)",
        "",
        "| model | method | configure_train (s) | aggregate_train (s) | pieces (median s) |",
        "|---|---|---|---|---|",
    ]
    for model, row in f1["models"].items():
        for method in ("fedhm", "fedavg"):
            p = row[method]
            pieces = ", ".join(
                f"{k} {v['median_s']:.3f}"
                for k, v in p.items()
                if k not in ("configure_train", "aggregate_train", "round / floor", "floor_code", "clock")
            )
            L.append(
                f"| {model} | {method} | {p['configure_train']['median_s']:.3f} "
                f"[{p['configure_train']['min_s']:.3f}–{p['configure_train']['max_s']:.3f}] | "
                f"{p['aggregate_train']['median_s']:.3f} "
                f"[{p['aggregate_train']['min_s']:.3f}–{p['aggregate_train']['max_s']:.3f}] | {pieces} |"
            )
        L.append(f"| {model} | FedHM / FedAvg | | | {row['fedhm_over_fedavg']:.2f}× |")
        for key, how in (
            ("fedhm", f"{row.get('threads', '')} threads, wall clock"),
            ("fedhm_1thread", "1 thread, thread CPU time"),
        ):
            ratio = row.get(key, {}).get("round / floor")
            if ratio is None:
                continue
            parts = row[key]
            L.append(
                f"| {model} | FedHM round (configure + aggregate + evaluation's factorization) / floor, {how} | "
                f"{parts['configure_train']['median_s']:.4f} | {parts['aggregate_train']['median_s']:.4f} | "
                f"round {parts['server_round']['median_s']:.4f} s, floor {parts['floor']['median_s']:.4f} s; "
                f"median of {ratio['repeats']} per-round ratios **{ratio['median_s']:.2f}×** "
                f"[{ratio['min_s']:.2f}–{ratio['max_s']:.2f}]"
                + (
                    f" (target ≤ {row['floor_target']:g}{'' if ratio['median_s'] <= row['floor_target'] else ' ✗'})"
                    if "floor_target" in row
                    else ""
                )
                + " |"
            )
    floor_code = next((r["fedhm"]["floor_code"] for r in f1["models"].values() if "floor_code" in r["fedhm"]), None)
    if floor_code:
        L += [
            "",
            "Floor code (plain torch, imports nothing from `fedhm_flwr` or `strategies`): "
            + "; ".join(f"`{c}`" for c in floor_code)
            + ".",
        ]
    s = f1["round_share"]
    L += [
        "",
        f"Server share of a round (CNN, 10 clients, in-process): {s['server_seconds']:.2f} s of "
        f"{s['round_seconds']:.2f} s = {100 * s['server_share']:.1f} % (evaluation {s['eval_seconds']:.2f} s).",
        "",
    ]
    return L


def bytes_markdown(f2: dict[str, Any]) -> list[str]:
    """Figure 2's section of the report."""
    L: list[str] = []
    L += [
        "## 2. Bytes per client per round (server → client; the reply is the same size)",
        "",
        "| model | level | serialized bytes | bytes ratio | params | params ratio |",
        "|---|---|---|---|---|---|",
    ]
    for model, rows in f2.items():
        for level, r in rows.items():
            L.append(
                f"| {model} | {level} | {r['serialized_bytes']:,} | {r['bytes_ratio']:.3f} | {r['params']:,} | "
                f"{r['params_ratio']:.3f} |"
            )
    L.append("")
    return L
