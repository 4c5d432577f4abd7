"""What the method and the framework cost, measured side by side (``make bench``).

Figures (each in one process, compared things on the same machine state, medians over repeats):

1. server time per round (factorize, build messages, recover, aggregate) of FedHM against FedAvg
   on the same model and number of replies; FedHM's whole server round (configure + aggregate +
   the evaluation's share of the factorization) against its floor (bench/floors.py, plain torch:
   one float32 ``eigh`` of the Gram matrix per factorizable layer plus one weighted average of the
   replies by stacked factor products, timed bare in the same process); and the server's share of a
   round's wall time;
2. bytes per client per round for each level, measured from the serialized messages, against the
   full model, next to the parameter-count ratio;
3. training-step time of each level's model against the full model (CPU at 1 thread and at all
   cores; GPU too when present), next to the MACs ratio, and their quotient against its target,
   for the clients' step and the step as it was; the profile of a level that misses its target;
4. local-training throughput inside a Flower simulation (``flwr run``, Ray) against a bare
   PyTorch loop on the same model, data and cores;
5. scale: 1000 simulated clients, 100 per round, through ``flwr run``: round 1 ÷ round 2, node-query
   time ÷ round time, server time ÷ round time, peak memory of the whole process tree;
6. ``wire.dtype``: bytes both ways and the accuracy cost of float16 / bfloat16 against float32
   (the default job, a few rounds in process, same seed);
7. checkpoint time ÷ round time, a checkpoint every round (the CNN and ResNet-18).

Writes ``bench/reports/bench.json`` and ``bench/reports/bench.md``. ``--quick`` shrinks every
figure (for a smoke test); ``--only 1,3`` runs some figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedhm_flwr.config import load_config, model_spec
from fedhm_flwr.models import build_model, count_macs, count_parameters, input_shape

REPORT_DIR = Path(__file__).resolve().parent / "reports"


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median and spread (min, max) of ``fn``'s wall time in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats}


# ------------------------------------------------------------------------------------ figure 1


def identity_query(msg: Any, context: Any) -> Any:
    """The node-info answer of a node that holds no data (figures 1 and 2 never train on any, and
    ResNet's CIFAR-10 need not be on this machine): its identity, without the example count the
    run's data spec would ask for (:func:`clients.base.node_info`)."""
    from flwr.app import Message, RecordDict

    from clients.base import node_info

    return Message(RecordDict({"config": node_info(context)}), reply_to=msg)


#: FedHM's server round ÷ its independent floor must stay under this (issue 25)
ROUND_OVER_FLOOR_TARGET = {"resnet18": 1.5, "cnn": 2.0}


def figure_server_time(quick: bool) -> dict[str, Any]:
    """configure_train + aggregate_train of FedHM vs FedAvg(full) with echoing clients."""
    from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict

    from fedhm_flwr.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.server_app import initial_state, run
    from strategies import STRATEGIES

    def echo(msg: Message, context: Any) -> Message:  # a client that trains instantly
        metrics = MetricRecord({"num-examples": 100, "train-loss": 0.0, "class-counts": [10] * 10})
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": metrics}), reply_to=msg)

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
            cfg = load_config(f"method={method} {extra} model={arch} model.width={width} dataset={dataset} "
                              f"num_clients={replies_n} fraction_train=1.0")
            spec = model_spec(cfg)
            strategy = STRATEGIES[method](cfg, spec)
            grid = LocalGrid(replies_n, {MessageType.TRAIN: echo, MessageType.QUERY: identity_query})
            state = initial_state(cfg, spec)
            arrays = ArrayRecord.from_torch_state_dict(state)
            counter = iter(range(1, 10_000))
            held: dict[str, Any] = {}

            def configure() -> None:
                held["round"] = next(counter)
                held["msgs"] = list(strategy.configure_train(held["round"], arrays, None, grid))

            def aggregate() -> None:
                strategy.aggregate_train(held["round"], held["replies"])

            configure()
            held["replies"] = grid.send_and_receive(held["msgs"])
            t_conf = timed(configure, repeats, warmup=0)
            held["replies"] = grid.send_and_receive(held["msgs"])
            t_agg = timed(aggregate, repeats, warmup=0)
            pieces: dict[str, Any] = {"configure_train": t_conf, "aggregate_train": t_agg}
            if method == "fedhm":  # chained rounds: each hands out a new model version (no cache hit)
                pieces = fedhm_round_against_floor(strategy, grid, state, repeats)
            row[method] = pieces
        row["fedhm_over_floor"] = row["fedhm"]["round / floor"]["median_s"]
        row["floor_target"] = ROUND_OVER_FLOOR_TARGET[arch]
        row["fedhm_over_fedavg"] = (
            (row["fedhm"]["configure_train"]["median_s"] + row["fedhm"]["aggregate_train"]["median_s"])
            / (row["fedavg"]["configure_train"]["median_s"] + row["fedavg"]["aggregate_train"]["median_s"]))
        out["models"][f"{arch}-w{width}"] = row
    # the server's share of a real round's wall time (in-process round with training, CNN)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("rounds=2 num_clients=10 fraction_train=1.0 dataset.max_train_examples=6000 "
                          "dataset.max_test_examples=2000 evaluation.levels=false")
        run(LocalGrid(10, client_handlers()), cfg, Path(tmp))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    out["round_share"] = {"model": "cnn-w16", "clients": 10, "round_seconds": last["seconds"],
                          "server_seconds": last["server_seconds"],
                          "eval_seconds": last.get("eval_seconds", 0.0),
                          "server_share": last["server_seconds"] / last["seconds"],
                          "note": "in-process grid: clients train one after another in the server process"}
    return out


def fedhm_round_against_floor(strategy: Any, grid: Any, state: dict[str, Any], repeats: int) -> dict[str, Any]:
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
    deserialised, right after the round it is compared with (the machine is shared).
    """
    from flwr.app import ArrayRecord

    from bench import floors

    arrays = ArrayRecord.from_torch_state_dict(state)
    names = strategy.factorized
    cut = [max(strategy.layer_ranks[name]) for name in names]
    keys = ("configure_train", "aggregate_train", "evaluation's factorization", "server_round",
            "floor: float32 eigh of the Gram, one per layer", "floor: weighted average", "floor", "round / floor")
    parts: dict[str, list[float]] = {key: [] for key in keys}
    for k in range(repeats + 1):  # the round and its floor alternate, so that both see the same machine
        t0 = time.perf_counter()
        msgs = list(strategy.configure_train(10_000 + k, arrays, None, grid))
        t1 = time.perf_counter()
        replies = grid.send_and_receive(msgs)
        t2 = time.perf_counter()
        arrays, _ = strategy.aggregate_train(10_000 + k, replies)
        t3 = time.perf_counter()
        merged = strategy.state_of(arrays)  # as the evaluation gets it
        for index in range(len(strategy.levels)):
            strategy.deployable(index, merged)
        t4 = time.perf_counter()
        floors.decomposition_floor([merged[f"{name}.weight"] for name in names], cut)
        t5 = time.perf_counter()
        hybrid = [m.content["arrays"].to_torch_state_dict() for m in replies]
        weights = [1.0 / len(hybrid)] * len(hybrid)
        t6 = time.perf_counter()
        floors.average_floor(merged, hybrid, weights)
        t7 = time.perf_counter()
        if k:  # the first round is a warm-up
            server, floor = (t1 - t0) + (t4 - t2), (t5 - t4) + (t7 - t6)
            for key, value in zip(keys, (t1 - t0, t3 - t2, t4 - t3, server, t5 - t4, t7 - t6, floor, server / floor)):
                parts[key].append(value)
    out: dict[str, Any] = {key: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "repeats": len(v)}
                           for key, v in parts.items()}
    out["floor_code"] = [floors.where(floors.decomposition_floor), floors.where(floors.average_floor)]
    return out


# ------------------------------------------------------------------------------------ figure 2


def serialized_bytes(msg: Any) -> int:
    """Bytes of a message as Flower ships it: the message and all its nested objects, deflated."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


def figure_bytes(quick: bool) -> dict[str, Any]:
    from flwr.app import ArrayRecord, MessageType

    from fedhm_flwr.local_grid import LocalGrid
    from fedhm_flwr.server_app import initial_state
    from strategies import STRATEGIES

    out = {}
    for arch, width, dataset in [("cnn", 16, "fashion_mnist")] + ([] if quick else [("resnet18", 64, "cifar10")]):
        cfg = load_config(f"model={arch} model.width={width} dataset={dataset} num_clients=8 fraction_train=1.0")
        spec = model_spec(cfg)
        strategy = STRATEGIES["fedhm"](cfg, spec)
        grid = LocalGrid(8, {MessageType.QUERY: identity_query})
        msgs = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(initial_state(cfg, spec)), None, grid))
        rows = {}
        for msg in msgs:
            level = float(msg.content["config"]["level"])
            if level in rows:
                continue
            index = int(msg.content["config"]["level-index"])
            rows[level] = {"serialized_bytes": serialized_bytes(msg),
                           "array_bytes": msg.content["arrays"].count_bytes(),
                           "params": int(strategy.level_cost(index)["params"])}
        full = rows[max(rows)]
        for r in rows.values():
            r["bytes_ratio"] = r["serialized_bytes"] / full["serialized_bytes"]
            r["params_ratio"] = r["params"] / full["params"]
        out[f"{arch}-w{width}"] = {f"{k:g}": v for k, v in sorted(rows.items(), reverse=True)}
    return out


# ------------------------------------------------------------------------------------ figure 3


#: step-time ratio ÷ MACs ratio a level must stay under (issue 15): ResNet-18 width 64, the CNN
STEP_OVER_MACS_TARGET = {"resnet18": 1.6, "cnn": 1.8}


def _train_steps(spec: dict[str, Any], batch: int, device: torch.device, variant: str
                 ) -> dict[str, tuple[Callable[[], None], int]]:
    """One SGD step (loss, backward with Frobenius decay, optimizer) per level: ``{gamma: (step, MACs)}``.

    ``variant`` ``before``: the step as it was (contiguous layout, the penalty added to the loss,
    the CNN's ReLU before its max-pool); ``train_local``: the clients' step
    (:func:`fedhm_flwr.train.conv_layout`, :func:`fedhm_flwr.train.backward`, the CNN pooling
    before its ReLU); ``relu_then_pool``: the clients' step with the CNN's ReLU before its
    max-pool, i.e. ``train_local`` less that one change (the same function, bit for bit)."""
    from fedhm_flwr.models.rules import plan_ranks
    from fedhm_flwr.train import backward, conv_layout, frobenius_penalty, parameter_groups

    base = build_model(spec)
    shape = input_shape(spec)
    steps = {}
    for gamma in (1.0, 0.5, 0.25, 0.125):
        ranks = plan_ranks(base, gamma)
        torch.manual_seed(0)
        model = build_model({**spec, "ranks": ranks}, spectral_init=False).train()
        if variant in ("before", "relu_then_pool") and hasattr(model, "relu_after_pool"):
            model.relu_after_pool = False
        macs = count_macs(model, shape)
        local = variant != "before"
        layout = conv_layout(model, device) if local else torch.contiguous_format
        model.to(device, memory_format=layout)
        opt = torch.optim.SGD(parameter_groups(model, 5e-4, bool(ranks)), lr=0.01, momentum=0.9)
        x = torch.randn(batch, *shape, device=device).contiguous(memory_format=layout)
        y = torch.randint(0, 10, (batch,), device=device)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt, x: torch.Tensor = x,
                 y: torch.Tensor = y) -> None:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            if local:
                backward(loss, model, 5e-4)
            else:
                (loss + frobenius_penalty(model, 5e-4)).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()

        steps[f"{gamma:g}"] = (step, macs)
    return steps


def _top_ops(step: Callable[[], None], steps: int, top: int = 8) -> list[dict[str, Any]]:
    """The ops with the largest self CPU time over ``steps`` steps (torch.profiler), with their shares."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "share": e.self_cpu_time_total / total, "ms_per_step": e.self_cpu_time_total / steps / 1e3,
             "calls_per_step": e.count / steps} for e in ranked]


def figure_train_step(quick: bool) -> dict[str, Any]:
    """Training-step time of each level ÷ the full model's, next to the MACs ratio, and their quotient
    (target: :data:`STEP_OVER_MACS_TARGET`), for the step as it was (``before``) and the clients'
    step (``train_local``), measured interleaved in this process (medians over repeats), at 1 thread
    (a simulated client's default, ``simulation.num_cpus=1``; timed by the thread's CPU time) and at
    all cores (wall clock: needs a quiet machine, as OpenMP threads wait on each other). A level over its target
    gets the profile of its step and of the full model's (top ops, shares of self CPU time)."""
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    configs = [("cnn", 16, 1, 28, 32)] + ([] if quick else [("resnet18", 64, 3, 32, 16)])
    cores = len(os.sched_getaffinity(0))  # not torch.get_num_threads(): in-process clients set it to theirs
    out: dict[str, Any] = {"threads": sorted({1, cores}), "variants": ["before", "relu_then_pool", "train_local"],
                           "target_step_over_macs": STEP_OVER_MACS_TARGET}
    try:
        for arch, width, channels, size, batch in configs:
            spec = {"arch": arch, "num_classes": 10, "in_channels": channels, "image_size": size, "width": width}
            target = STEP_OVER_MACS_TARGET[arch]
            for device in devices:
                for threads in (out["threads"] if device.type == "cpu" else [cores]):
                    torch.set_num_threads(threads)
                    # one thread: the calling thread's CPU time (all of a 1-thread step runs on it), so
                    # that other processes on the machine do not stretch some steps and not others
                    single = threads == 1 and device.type == "cpu"
                    clock = time.thread_time if single else time.perf_counter
                    variants = {v: _train_steps(spec, batch, device, v) for v in out["variants"]
                                if arch == "cnn" or v != "relu_then_pool"}  # the CNN's change only
                    times: dict[tuple[str, str], list[float]] = {(v, g): [] for v, s in variants.items() for g in s}
                    repeats = 3 if quick else (40 if arch == "cnn" else 5)
                    inner = 3 if arch == "cnn" else 1
                    for (v, g) in times:  # warm-up
                        variants[v][g][0]()
                    for _ in range(repeats):  # interleaved: every (variant, level) sees the same machine state
                        for (v, g), ts in times.items():
                            t0 = clock()
                            for _ in range(inner):
                                variants[v][g][0]()
                            ts.append((clock() - t0) / inner)
                    table: dict[str, Any] = {"clock": "thread CPU time" if single else "wall clock"}
                    for v, steps in variants.items():
                        full_t, full_m = statistics.median(times[(v, "1")]), steps["1"][1]
                        rows = {}
                        for g, (step, macs) in steps.items():
                            ts = times[(v, g)]
                            t = statistics.median(ts)
                            rows[g] = {"median_s": t, "min_s": min(ts), "max_s": max(ts), "repeats": repeats,
                                       "batch": batch, "macs": macs, "time_ratio": t / full_t, "macs_ratio": macs / full_m,
                                       "step_over_macs": (t / full_t) / (macs / full_m)}
                            rows[g]["meets_target"] = rows[g]["step_over_macs"] <= target
                        table[v] = rows
                    missed = [g for g, r in table["train_local"].items() if not r["meets_target"]]
                    if missed and device.type == "cpu" and not quick:
                        table["profile"] = {g: _top_ops(variants["train_local"][g][0], 3 if arch == "cnn" else 1)
                                            for g in ["1", *missed]}
                    out[f"{arch}-w{width}-{device.type}-threads{threads}"] = table
    finally:
        torch.set_num_threads(cores)
    return out


def train_step_markdown(f3: dict[str, Any]) -> list[str]:
    """Figure 3's section of the report."""
    L = [f"## 3. Training-step time per level (threads {f3['threads']})", "",
         "Step-time ratio (level ÷ full model, same variant) next to the MACs ratio; their quotient must "
         f"stay under {f3['target_step_over_macs']}. `before`: contiguous layout, Frobenius penalty through "
         "autograd, the CNN's ReLU before its max-pool; `train_local`: the clients' step (channels_last, "
         "closed-form Frobenius gradient, the CNN pooling before its ReLU: the same function, bit for bit); "
         "`relu_then_pool` (CNN): `train_local` with the ReLU before the max-pool.", "",
         "One thread is timed by the thread's CPU time, more threads by the wall clock (quiet machine needed).", "",
         "| model/device | variant | level | step median (s) [min–max] | time ratio | MACs ratio | time ÷ MACs |",
         "|---|---|---|---|---|---|---|"]
    for model, table in f3.items():
        if not isinstance(table, dict) or "train_local" not in table:
            continue
        for variant in [v for v in f3["variants"] if v in table]:
            for level, r in table[variant].items():
                mark = "" if r["meets_target"] else " ✗"
                L.append(f"| {model} | {variant} | {level} | {r['median_s']:.4f} [{r['min_s']:.4f}–{r['max_s']:.4f}] | "
                         f"{r['time_ratio']:.2f} | {r['macs_ratio']:.2f} | {r['step_over_macs']:.2f}{mark} |")
    for model, table in f3.items():
        if isinstance(table, dict) and "profile" in table:
            L += ["", f"Profile of `train_local` steps, {model} (top ops, share of self CPU time):", ""]
            for level, ops in table["profile"].items():
                L.append(f"* level {level}: " + ", ".join(f"{o['op']} {100 * o['share']:.0f} %" for o in ops))
    L.append("")
    return L


# ------------------------------------------------------------------------------------ figure 4


def figure_throughput(quick: bool) -> dict[str, Any]:
    from fedhm_flwr.data import client_dataset
    from fedhm_flwr.launch import run_job

    n_train = 4000 if quick else 12000
    overrides = ["rounds=1", "num_clients=2", "fraction_train=1.0", "levels.ratios=[1]", f"dataset.max_train_examples={n_train}",
                 "dataset.max_test_examples=500", "evaluation.levels=false", "train.local_epochs=2"]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = run_job(overrides, Path(tmp) / "run", quiet=True)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(overrides)
    spec = model_spec(cfg)
    from fedhm_flwr.config import data_spec

    dspec = data_spec(cfg, 2)
    examples = sum(len(client_dataset(dspec, p)) for p in range(2)) * 2  # two epochs
    flower = {"clients": 2, "threads_per_client": 1, "client_seconds_max": rows[-1]["client_seconds_max"],
              "images_per_s_all_clients": examples / rows[-1]["client_seconds_max"],
              "round_seconds": rows[-1]["seconds"], "job_wall_seconds": wall,
              "final_acc": summary.get("final_acc/global")}
    from bench import floors

    data = []
    for p in range(2):  # the partitions as tensors (the floor trains on tensors; loading is not timed)
        ds = client_dataset(dspec, p)
        xs, ys = zip(*(ds[i] for i in range(len(ds))))
        data.append((torch.stack(xs), torch.as_tensor(ys)))
    bare = {"floor_code": floors.where(floors.training_floor)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for images, labels in data:
            torch.manual_seed(0)
            floors.training_floor(build_model(spec), images, labels, epochs=2, batch_size=32,
                                  lr=float(cfg.train.lr), momentum=float(cfg.train.momentum),
                                  weight_decay=float(cfg.train.weight_decay))
        secs = time.perf_counter() - t0
        bare[f"{threads}_threads_sequential"] = {"seconds": secs, "images_per_s": examples / secs}
    torch.set_num_threads(os.cpu_count() or 1)
    return {"examples": examples, "flower_simulation": flower, "bare_pytorch": bare,
            "flower_over_bare_1thread": flower["images_per_s_all_clients"] / bare["1_threads_sequential"]["images_per_s"]}


# ------------------------------------------------------------------------------------ figure 5


class TreeMemory:
    """Samples the resident memory of this process and all its descendants (Linux /proc)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                    kids.setdefault(ppid, []).append(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
        return kids

    def _rss(self) -> int:
        kids, total, todo = self._children(), 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                with open(f"/proc/{pid}/status") as fh:
                    for line in fh:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def __enter__(self) -> TreeMemory:
        def loop() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._rss())
                self._stop.wait(self.interval)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def scale_run(clients: int, per_round: int, rounds: int, query: str) -> dict[str, Any]:
    """One ``flwr run`` of ``clients`` simulated clients, ``per_round`` sampled per round, with
    ``availability.query`` = ``query``: per-round times and the ratios measured in that run."""
    from fedhm_flwr.launch import run_job

    overrides = [f"num_clients={clients}", f"fraction_train={per_round / clients}", f"rounds={rounds}",
                 "evaluation.levels=false", "dataset.max_test_examples=2000", f"availability.query={query}"]
    with tempfile.TemporaryDirectory() as tmp, TreeMemory() as mem:
        t0 = time.perf_counter()
        summary = run_job(overrides, Path(tmp) / "run", quiet=True)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rows]
    queries = [r.get("query_seconds", 0.0) for r in rows]
    servers = [r["server_seconds"] for r in rows]
    asked = [r.get("queried", 0) for r in rows]
    # blocking query time per asked node in the rounds that asked any (warm workers; with
    # ``sampled`` mostly asked ahead, during the previous round's evaluation)
    later = [(q, n) for q, n in zip(queries, asked) if n]
    per_node = sum(q for q, _ in later) / sum(n for _, n in later) if later else None
    return {"query": query, "round_seconds": seconds, "server_seconds": servers, "query_seconds": queries,
            "replies": [r["replies"] for r in rows], "bytes_queries": [r.get("bytes_queries", 0) for r in rows],
            "queried": asked, "query_seconds_per_node": per_node,
            # the start-up before round 1 (NodeRegistry.startup): the simulation's workers start on
            # their first message (importing torch and the ClientApp) and the nodes find their data
            "startup_seconds": summary.get("startup_seconds"), "startup_queried": summary.get("startup_queried"),
            "round1_over_round2": seconds[0] / seconds[1] if len(seconds) > 1 else None,
            "query_share": [q / s for q, s in zip(queries, seconds)],
            "max_query_share": max(q / s for q, s in zip(queries, seconds)),
            "server_share": [v / s for v, s in zip(servers, seconds)],
            "job_wall_seconds": wall, "peak_rss_bytes_process_tree": mem.peak,
            "final_acc": summary.get("final_acc/global")}


#: ``--scale-clients``: a second run of figure 5 at this many clients (100 per round), next to the 1000
SCALE_CLIENTS: int | None = None


def server_state_per_node(counts: tuple[int, ...], per_round: int = 100, rounds: int = 2) -> dict[str, Any]:
    """The server's per-node state (node registry, caches: what ``strategies/`` allocates and keeps)
    after the start-up and ``rounds`` rounds of ``per_round`` echoing clients (CNN, in process), for
    each node count: traced bytes kept (tracemalloc, allocations made in ``strategies/``), per node."""
    import gc
    import tracemalloc

    from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict

    from fedhm_flwr.local_grid import LocalGrid
    from fedhm_flwr.server_app import initial_state
    from strategies import STRATEGIES

    def echo(msg: Message, context: Any) -> Message:
        metrics = MetricRecord({"num-examples": 100, "train-loss": 0.0, "class-counts": [10] * 10})
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": metrics}), reply_to=msg)

    rows = {}
    for n in (counts[0], *counts):  # the first one warms up (imports, one-time caches) and is not kept
        cfg = load_config([f"num_clients={n}", f"fraction_train={per_round / n}", "availability.query=all"])
        spec = model_spec(cfg)
        grid = LocalGrid(n, {MessageType.TRAIN: echo, MessageType.QUERY: identity_query})
        arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg, spec))
        gc.collect()
        tracemalloc.start()
        strategy = STRATEGIES["fedhm"](cfg, spec)
        t0 = time.perf_counter()
        strategy.registry.startup(grid, 1)
        startup = time.perf_counter() - t0
        for r in range(1, rounds + 1):
            replies = grid.send_and_receive(list(strategy.configure_train(r, arrays, None, grid)))
            arrays, _ = strategy.aggregate_train(r, replies)
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/strategies/*")])
        tracemalloc.stop()
        kept = sum(stat.size for stat in snapshot.statistics("filename"))
        rows[str(n)] = {"nodes": n, "known": len(strategy.registry.nodes), "server_state_bytes": kept,
                        "bytes_per_known_node": kept / max(1, len(strategy.registry.nodes)), "startup_seconds": startup}
        del strategy, grid
    base, top = rows[str(counts[0])], rows[str(counts[-1])]
    slope = (top["server_state_bytes"] - base["server_state_bytes"]) / max(1, counts[-1] - counts[0])
    return {"per_round": per_round, "rounds": rounds, "rows": rows, "bytes_per_node": slope,
            "note": "allocations made in strategies/ and still held (tracemalloc), CNN, echoing clients, "
                    "availability.query=all: every node known"}


def figure_scale(quick: bool) -> dict[str, Any]:
    """1000 clients, 100 per round (``--quick``: 200, 20): round 1 ÷ round 2, query time ÷ round
    time, server time ÷ round time and peak memory, each measured in the same run; with
    ``availability.query=sampled`` (a round asks only its own new nodes), and, outside ``--quick``,
    with ``all`` (every node asked when it connects) for comparison. With ``--scale-clients N``:
    also N clients, 100 per round (``sampled``), its round 2 against the 1000-client one's, and the
    server's per-node state at 1000, N/2 and N nodes (:func:`server_state_per_node`)."""
    clients, per_round, rounds = (200, 20, 2) if quick else (1000, 100, 3)
    runs = {query: scale_run(clients, per_round, rounds, query) for query in (("sampled",) if quick else ("sampled", "all"))}
    out: dict[str, Any] = {"clients": clients, "per_round": per_round, "rounds": rounds, "runs": runs,
                           "goal": "round 1 <= 1.5 x round 2; query time <= 5 % of every round; peak memory < 8 GiB"}
    if SCALE_CLIENTS:
        big = scale_run(SCALE_CLIENTS, per_round, rounds, "sampled")
        big["round2_over_small_round2"] = big["round_seconds"][1] / runs["sampled"]["round_seconds"][1]
        out["large"] = {"clients": SCALE_CLIENTS, "run": big,
                        "goal": f"peak memory < 8 GiB; round 2 <= 1.5 x the {clients}-client round 2",
                        "server_state": server_state_per_node((clients, SCALE_CLIENTS // 2, SCALE_CLIENTS))}
    return out


# ------------------------------------------------------------------------------------ figure 6


def figure_wire(quick: bool) -> dict[str, Any]:
    """``wire.dtype``: bytes per parameter both ways and the accuracy cost, the default job
    (FedHM, CNN, Fashion-MNIST, 20 clients, half sampled) for a few rounds in process, the same
    seed for every dtype."""
    from fedhm_flwr.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.server_app import run

    rounds = 2 if quick else 3
    common = [f"rounds={rounds}", "evaluation.levels=false"] + (
        ["dataset.max_train_examples=6000", "dataset.max_test_examples=2000"] if quick else [])
    out: dict[str, Any] = {"rounds": rounds, "overrides": common, "dtypes": {}}
    for dtype in ("float32", "float16", "bfloat16"):
        cfg = load_config(common + [f"wire.dtype={dtype}"])
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp))
            wall = time.perf_counter() - t0
            rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        out["dtypes"][dtype] = {"bytes_sent": sum(r["bytes_sent"] for r in rows),
                                "bytes_received": sum(r["bytes_received"] for r in rows),
                                "final_acc": rows[-1]["acc/global"], "final_loss": rows[-1]["loss/global"],
                                "wall_seconds": wall, "summary_final_acc": summary.get("final_acc/global")}
    ref = out["dtypes"]["float32"]
    for row in out["dtypes"].values():
        row["bytes_ratio"] = (row["bytes_sent"] + row["bytes_received"]) / (ref["bytes_sent"] + ref["bytes_received"])
        row["acc_cost_pt"] = 100 * (ref["final_acc"] - row["final_acc"])
    return out


# ------------------------------------------------------------------------------------ figure 7


def figure_checkpoint(quick: bool) -> dict[str, Any]:
    """Checkpoint time ÷ round time (goal < 5 %): the default job's FedHM with the CNN and with
    ResNet-18 on Fashion-MNIST, in process, a checkpoint every round (``checkpoint.every=1``,
    the default: the model and the strategy state written and renamed, fsync'ed). Both times are
    the run's own: each row's ``seconds`` and the summary's ``checkpoint_seconds``. The data is
    cut (fewer examples per client), so the rounds are shorter than the default job's: the
    ratio is an upper bound of the default job's."""
    from fedhm_flwr.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.server_app import run

    rounds, examples = (2, 1000) if quick else (3, 4000)
    out: dict[str, Any] = {"rounds": rounds, "max_train_examples": examples, "goal": "checkpoint ÷ round < 5 %",
                           "models": {}}
    for model in ("cnn", "resnet18"):
        cfg = load_config([f"model={model}", f"rounds={rounds}", f"dataset.max_train_examples={examples}",
                           "dataset.max_test_examples=1000", "evaluation.levels=false", "checkpoint.every=1"])
        with tempfile.TemporaryDirectory() as tmp:
            summary = run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp))
            size = (Path(tmp) / "checkpoint" / "global_model.safetensors").stat().st_size
        out["models"][model] = {"checkpoint_seconds": summary["checkpoint_seconds"] / rounds,
                                "round_seconds": summary["seconds_rounds"] / rounds, "checkpoint_bytes": size,
                                "ratio": summary["checkpoint_seconds"] / summary["seconds_rounds"]}
    return out


def checkpoint_markdown(f7: dict[str, Any]) -> list[str]:
    L = [f"## 7. Checkpoint time ÷ round time (a checkpoint every round; {f7['rounds']} rounds, "
         f"{f7['max_train_examples']:,} training examples: an upper bound)", "", f"Goal: {f7['goal']}.", "",
         "| model | checkpoint (MB) | checkpoint s / round | round s | checkpoint ÷ round |", "|---|---|---|---|---|"]
    for model, r in f7["models"].items():
        L.append(f"| {model} | {r['checkpoint_bytes'] / 1e6:.1f} | {r['checkpoint_seconds']:.3f} | "
                 f"{r['round_seconds']:.2f} | **{100 * r['ratio']:.2f} %** |")
    return L + [""]


# ------------------------------------------------------------------------------------ report


def markdown(report: dict[str, Any]) -> str:
    L = [f"# fedhm-flwr benchmarks", "", f"{report['machine']}", ""]
    f1 = report.get("figures", {}).get("1_server_time")
    if f1:
        L += ["## 1. Server time per round (10 replies, medians)", "",
              "| model | method | configure_train (s) | aggregate_train (s) | pieces (median s) |", "|---|---|---|---|---|"]
        for model, row in f1["models"].items():
            for method in ("fedhm", "fedavg"):
                p = row[method]
                pieces = ", ".join(f"{k} {v['median_s']:.3f}" for k, v in p.items()
                                   if k not in ("configure_train", "aggregate_train", "round / floor", "floor_code"))
                L.append(f"| {model} | {method} | {p['configure_train']['median_s']:.3f} "
                         f"[{p['configure_train']['min_s']:.3f}–{p['configure_train']['max_s']:.3f}] | "
                         f"{p['aggregate_train']['median_s']:.3f} [{p['aggregate_train']['min_s']:.3f}–{p['aggregate_train']['max_s']:.3f}] | {pieces} |")
            L.append(f"| {model} | FedHM / FedAvg | | | {row['fedhm_over_fedavg']:.2f}× |")
            if "fedhm_over_floor" in row:
                L.append(f"| {model} | FedHM round (configure + aggregate + evaluation's factorization) / floor | | | "
                         f"median of per-round ratios **{row['fedhm_over_floor']:.2f}×** "
                         f"[{row['fedhm']['round / floor']['min_s']:.2f}–{row['fedhm']['round / floor']['max_s']:.2f}]"
                         + (f" (target ≤ {row['floor_target']:g}{'' if row['fedhm_over_floor'] <= row['floor_target'] else ' ✗'})"
                            if "floor_target" in row else "") + " |")
        floor_code = next((r["fedhm"]["floor_code"] for r in f1["models"].values() if "floor_code" in r["fedhm"]), None)
        if floor_code:
            L += ["", "Floor code (plain torch, imports nothing from `fedhm_flwr` or `strategies`): "
                  + "; ".join(f"`{c}`" for c in floor_code) + "."]
        s = f1["round_share"]
        L += ["", f"Server share of a round (CNN, 10 clients, in-process): {s['server_seconds']:.2f} s of "
              f"{s['round_seconds']:.2f} s = {100 * s['server_share']:.1f} % (evaluation {s['eval_seconds']:.2f} s).", ""]
    f2 = report.get("figures", {}).get("2_bytes")
    if f2:
        L += ["## 2. Bytes per client per round (server → client; the reply is the same size)", "",
              "| model | level | serialized bytes | bytes ratio | params | params ratio |", "|---|---|---|---|---|---|"]
        for model, rows in f2.items():
            for level, r in rows.items():
                L.append(f"| {model} | {level} | {r['serialized_bytes']:,} | {r['bytes_ratio']:.3f} | {r['params']:,} | {r['params_ratio']:.3f} |")
        L.append("")
    f3 = report.get("figures", {}).get("3_train_step")
    if f3:
        L += train_step_markdown(f3)
    f4 = report.get("figures", {}).get("4_throughput")
    if f4:
        fl, bare = f4["flower_simulation"], f4["bare_pytorch"]
        L += ["## 4. Local-training throughput: Flower simulation vs bare PyTorch", "",
              f"Same CNN, data ({f4['examples']:,} image-epochs over 2 partitions) and 2 cores.", "",
              "| setting | images/s |", "|---|---|",
              f"| Flower simulation, 2 clients × 1 thread in parallel (client training time) | {fl['images_per_s_all_clients']:.0f} |",
              f"| bare loop, 1 thread, partitions one after another | {bare['1_threads_sequential']['images_per_s']:.0f} |",
              f"| bare loop, 2 threads, partitions one after another | {bare['2_threads_sequential']['images_per_s']:.0f} |",
              "", f"Flower round wall time {fl['round_seconds']:.1f} s; whole job (SuperLink, Ray start, evaluation) "
              f"{fl['job_wall_seconds']:.1f} s." + (f" Bare loop: `{bare['floor_code']}` (plain torch)."
                                                   if "floor_code" in bare else ""), ""]
    f5 = report.get("figures", {}).get("5_scale")
    if f5:
        L += [f"## 5. Scale: {f5['clients']} simulated clients, {f5['per_round']} per round", "",
              f"Goal: {f5['goal']}.", "",
              "| availability.query | round | seconds | server s | nodes asked | query s | query ÷ round | server ÷ round | replies |",
              "|---|---|---|---|---|---|---|---|---|"]
        for query, r in f5["runs"].items():
            for i, (s, ss, na, qs, n) in enumerate(zip(r["round_seconds"], r["server_seconds"], r["queried"],
                                                       r["query_seconds"], r["replies"]), 1):
                L.append(f"| {query} | {i} | {s:.1f} | {ss:.2f} | {na} | {qs:.2f} | {100 * qs / s:.1f} % | "
                         f"{100 * ss / s:.1f} % | {n} |")
        L.append("")
        for query, r in f5["runs"].items():
            ratio = r["round1_over_round2"]
            L.append(f"- `{query}`: round 1 ÷ round 2 **{ratio:.2f}**; largest query share "
                     f"**{100 * r['max_query_share']:.1f} %**; peak resident memory of the process tree (launcher, "
                     f"SuperLink, ServerApp, Ray) **{r['peak_rss_bytes_process_tree'] / 2**30:.2f} GiB**; "
                     f"job {r['job_wall_seconds']:.0f} s." + (
                         f" Blocking query time per asked node {1000 * r['query_seconds_per_node']:.1f} ms."
                         if r.get("query_seconds_per_node") else "") + (
                         f" Start-up before round 1 (Ray workers start on their first message, importing torch "
                         f"and the ClientApp; nodes find their data): {r['startup_seconds']:.1f} s, "
                         f"{r['startup_queried']} nodes asked." if r.get("startup_seconds") is not None else ""))
        L.append("")
    large = (f5 or {}).get("large")
    if large:
        r, st = large["run"], large["server_state"]
        L += [f"### {large['clients']:,} simulated clients, {f5['per_round']} per round (`availability.query=sampled`)", "",
              f"Goal: {large['goal']}.", "",
              "| round | seconds | server s | nodes asked | replies |", "|---|---|---|---|---|"]
        for i, (sec, ss, na, n) in enumerate(zip(r["round_seconds"], r["server_seconds"], r["queried"], r["replies"]), 1):
            L.append(f"| {i} | {sec:.1f} | {ss:.2f} | {na} | {n} |")
        L += ["", f"- round 2 ÷ the {f5['clients']}-client round 2: **{r['round2_over_small_round2']:.2f}**; "
              f"peak resident memory of the process tree **{r['peak_rss_bytes_process_tree'] / 2**30:.2f} GiB**; "
              f"start-up before round 1 {r['startup_seconds'] or 0:.1f} s ({r['startup_queried']} nodes asked); "
              f"job {r['job_wall_seconds']:.0f} s.",
              f"- The server's per-node state ({st['note']}): "
              + ", ".join(f"{int(k):,} nodes {v['server_state_bytes'] / 2**20:.2f} MiB "
                          f"({v['bytes_per_known_node']:.0f} B per known node)" for k, v in st["rows"].items())
              + f"; **{st['bytes_per_node']:.0f} bytes per node** (slope).", ""]
    f6 = report.get("figures", {}).get("6_wire")
    if f6:
        L += [f"## 6. Wire dtype: bytes and accuracy cost (default job, {f6['rounds']} rounds, in process, same seed)", "",
              "| wire.dtype | bytes sent + received | ÷ float32 | final accuracy | cost vs float32 (pt) |",
              "|---|---|---|---|---|"]
        for dtype, r in f6["dtypes"].items():
            L.append(f"| {dtype} | {r['bytes_sent'] + r['bytes_received']:,} | {r['bytes_ratio']:.3f} | "
                     f"{r['final_acc']:.4f} | {r['acc_cost_pt']:+.2f} |")
        L.append("")
    if report.get("figures", {}).get("7_checkpoint"):
        L += checkpoint_markdown(report["figures"]["7_checkpoint"])
    return "\n".join(L)


FIGURES = {"1": ("1_server_time", figure_server_time), "2": ("2_bytes", figure_bytes),
           "3": ("3_train_step", figure_train_step), "4": ("4_throughput", figure_throughput),
           "5": ("5_scale", figure_scale), "6": ("6_wire", figure_wire), "7": ("7_checkpoint", figure_checkpoint)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--only", default="1,2,3,4,5,6,7", help="comma-separated figure numbers")
    parser.add_argument("--out", type=Path, default=REPORT_DIR)
    parser.add_argument("--scale-clients", type=int, default=None,
                        help="figure 5 also runs this many clients, 100 per round (e.g. 10000; heavy)")
    args = parser.parse_args(argv)
    global SCALE_CLIENTS
    SCALE_CLIENTS = args.scale_clients
    report: dict[str, Any] = {
        "machine": f"{platform.node()} · {os.cpu_count()} CPUs · torch {torch.__version__} · "
                   f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        "quick": args.quick, "figures": {}}
    for key in args.only.split(","):
        name, fn = FIGURES[key.strip()]
        t0 = time.perf_counter()
        print(f"[bench] figure {name} ...", flush=True)
        report["figures"][name] = fn(args.quick)
        print(f"[bench] figure {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(report, indent=1))
        (args.out / "bench.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
