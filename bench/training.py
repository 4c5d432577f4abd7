"""Figures 3 and 4: each level's training-step time against its MACs, and local training inside
a Flower simulation against a bare PyTorch loop (:func:`bench.floors.training_floor`)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedhm_flwr.config import load_config, model_spec
from fedhm_flwr.models import build_model, count_macs, input_shape

# ------------------------------------------------------------------------------------ figure 3


#: step-time ratio ÷ MACs ratio a level must stay under (issue 15): ResNet-18 width 64, the CNN
STEP_OVER_MACS_TARGET = {"resnet18": 1.6, "cnn": 1.8}


def _train_steps(
    spec: dict[str, Any], batch: int, device: torch.device, variant: str
) -> dict[str, tuple[Callable[[], None], int]]:
    """One SGD step (loss, backward with Frobenius decay, optimizer) per level: ``{gamma: (step, MACs)}``.

    ``variant`` ``before``: the step as it was (contiguous layout, the penalty added to the loss,
    the CNN's ReLU before its max-pool); ``train_local``: the clients' step
    (:func:`fedhm_flwr.math.train.conv_layout`, :func:`fedhm_flwr.math.train.backward`, the CNN pooling
    before its ReLU); ``relu_then_pool``: the clients' step with the CNN's ReLU before its
    max-pool, i.e. ``train_local`` less that one change (the same function, bit for bit)."""
    from fedhm_flwr.math.train import backward, conv_layout, frobenius_penalty, parameter_groups
    from fedhm_flwr.models.rules import plan_ranks

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

        def step(
            model: torch.nn.Module = model,
            opt: torch.optim.Optimizer = opt,
            x: torch.Tensor = x,
            y: torch.Tensor = y,
            local: bool = local,
        ) -> None:
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
    return [
        {
            "op": e.key,
            "share": e.self_cpu_time_total / total,
            "ms_per_step": e.self_cpu_time_total / steps / 1e3,
            "calls_per_step": e.count / steps,
        }
        for e in ranked
    ]


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
    out: dict[str, Any] = {
        "threads": sorted({1, cores}),
        "variants": ["before", "relu_then_pool", "train_local"],
        "target_step_over_macs": STEP_OVER_MACS_TARGET,
    }
    try:
        for arch, width, channels, size, batch in configs:
            spec = {"arch": arch, "num_classes": 10, "in_channels": channels, "image_size": size, "width": width}
            target = STEP_OVER_MACS_TARGET[arch]
            for device in devices:
                for threads in out["threads"] if device.type == "cpu" else [cores]:
                    torch.set_num_threads(threads)
                    # one thread: the calling thread's CPU time (all of a 1-thread step runs on it), so
                    # that other processes on the machine do not stretch some steps and not others
                    single = threads == 1 and device.type == "cpu"
                    clock = time.thread_time if single else time.perf_counter
                    variants = {
                        v: _train_steps(spec, batch, device, v)
                        for v in out["variants"]
                        if arch == "cnn" or v != "relu_then_pool"
                    }  # the CNN's change only
                    times: dict[tuple[str, str], list[float]] = {(v, g): [] for v, s in variants.items() for g in s}
                    repeats = 3 if quick else (40 if arch == "cnn" else 5)
                    inner = 3 if arch == "cnn" else 1
                    for v, g in times:  # warm-up
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
                        for g, (_step, macs) in steps.items():
                            ts = times[(v, g)]
                            t = statistics.median(ts)
                            rows[g] = {
                                "median_s": t,
                                "min_s": min(ts),
                                "max_s": max(ts),
                                "repeats": repeats,
                                "batch": batch,
                                "macs": macs,
                                "time_ratio": t / full_t,
                                "macs_ratio": macs / full_m,
                                "step_over_macs": (t / full_t) / (macs / full_m),
                            }
                            rows[g]["meets_target"] = rows[g]["step_over_macs"] <= target
                        table[v] = rows
                    missed = [g for g, r in table["train_local"].items() if not r["meets_target"]]
                    if missed and device.type == "cpu" and not quick:
                        table["profile"] = {
                            g: _top_ops(variants["train_local"][g][0], 3 if arch == "cnn" else 1)
                            for g in ["1", *missed]
                        }
                    out[f"{arch}-w{width}-{device.type}-threads{threads}"] = table
    finally:
        torch.set_num_threads(cores)
    return out


def train_step_markdown(f3: dict[str, Any]) -> list[str]:
    """Figure 3's section of the report."""
    L = [
        f"## 3. Training-step time per level (threads {f3['threads']})",
        "",
        "Step-time ratio (level ÷ full model, same variant) next to the MACs ratio; their quotient must "
        f"stay under {f3['target_step_over_macs']}. `before`: contiguous layout, Frobenius penalty through "
        "autograd, the CNN's ReLU before its max-pool; `train_local`: the clients' step (channels_last, "
        "closed-form Frobenius gradient, the CNN pooling before its ReLU: the same function, bit for bit); "
        "`relu_then_pool` (CNN): `train_local` with the ReLU before the max-pool.",
        "",
        "One thread is timed by the thread's CPU time, more threads by the wall clock (quiet machine needed).",
        "",
        "| model/device | variant | level | step median (s) [min–max] | time ratio | MACs ratio | time ÷ MACs |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, table in f3.items():
        if not isinstance(table, dict) or "train_local" not in table:
            continue
        for variant in [v for v in f3["variants"] if v in table]:
            for level, r in table[variant].items():
                mark = "" if r["meets_target"] else " ✗"
                L.append(
                    f"| {model} | {variant} | {level} | {r['median_s']:.4f} [{r['min_s']:.4f}–{r['max_s']:.4f}] | "
                    f"{r['time_ratio']:.2f} | {r['macs_ratio']:.2f} | {r['step_over_macs']:.2f}{mark} |"
                )
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
    from fedhm_flwr.ops.job.launch import run_job

    n_train = 4000 if quick else 12000
    overrides = [
        "rounds=1",
        "num_clients=2",
        "fraction_train=1.0",
        "levels.ratios=[1]",
        f"dataset.max_train_examples={n_train}",
        "dataset.max_test_examples=500",
        "evaluation.levels=false",
        "train.local_epochs=2",
    ]
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
    flower = {
        "clients": 2,
        "threads_per_client": 1,
        "client_seconds_max": rows[-1]["client_seconds_max"],
        "images_per_s_all_clients": examples / rows[-1]["client_seconds_max"],
        "round_seconds": rows[-1]["seconds"],
        "job_wall_seconds": wall,
        "final_acc": summary.get("final_acc/global"),
    }
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
            floors.training_floor(
                build_model(spec),
                images,
                labels,
                epochs=2,
                batch_size=32,
                lr=float(cfg.train.lr),
                momentum=float(cfg.train.momentum),
                weight_decay=float(cfg.train.weight_decay),
            )
        secs = time.perf_counter() - t0
        bare[f"{threads}_threads_sequential"] = {"seconds": secs, "images_per_s": examples / secs}
    torch.set_num_threads(os.cpu_count() or 1)
    return {
        "examples": examples,
        "flower_simulation": flower,
        "bare_pytorch": bare,
        "flower_over_bare_1thread": flower["images_per_s_all_clients"] / bare["1_threads_sequential"]["images_per_s"],
    }


def throughput_markdown(f4: dict[str, Any]) -> list[str]:
    """Figure 4's section of the report."""
    L: list[str] = []
    fl, bare = f4["flower_simulation"], f4["bare_pytorch"]
    L += [
        "## 4. Local-training throughput: Flower simulation vs bare PyTorch",
        "",
        f"Same CNN, data ({f4['examples']:,} image-epochs over 2 partitions) and 2 cores.",
        "",
        "| setting | images/s |",
        "|---|---|",
        "| Flower simulation, 2 clients × 1 thread in parallel (client training time) | "
        f"{fl['images_per_s_all_clients']:.0f} |",
        f"| bare loop, 1 thread, partitions one after another | {bare['1_threads_sequential']['images_per_s']:.0f} |",
        f"| bare loop, 2 threads, partitions one after another | {bare['2_threads_sequential']['images_per_s']:.0f} |",
        "",
        f"Flower round wall time {fl['round_seconds']:.1f} s; whole job (SuperLink, Ray start, evaluation) "
        f"{fl['job_wall_seconds']:.1f} s."
        + (f" Bare loop: `{bare['floor_code']}` (plain torch)." if "floor_code" in bare else ""),
        "",
    ]
    return L
