"""Figure 8's floor: the whole job's bare loop, ``python -m bench.whole_job_floor job.json out.json``.

FedHM's default job written out by hand in plain torch: its IDX files read with gzip + numpy, HeteroFL's
CNN (width 16, static batch norm), each client's model cut by torch.linalg.svd at its level's rank,
trained, multiplied back and averaged; the global model and each level's model evaluated every round.
The job hands it data only: the partitions' indices and each round's (partition, level) pairs.

Like :mod:`bench.floors` (whose :func:`~bench.floors.unroll` it shares), nothing here imports ``fedhm_flwr``
(tests/test_bench_floors.py checks the imports, and that the loop computes what the job computes).
"""

from __future__ import annotations

import gzip
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bench.floors import unroll

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's pixel mean and standard deviation


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzip): its big-endian header (magic, dimensions), then uint8 values."""
    raw = gzip.decompress(path.read_bytes())
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(folder: Path, split: str) -> tuple[Tensor, Tensor]:
    """``(images (N, 1, 28, 28) normalised float32, labels int64)`` of ``train`` or ``t10k``."""
    images = read_idx(folder / f"{split}-images-idx3-ubyte.gz")
    labels = read_idx(folder / f"{split}-labels-idx1-ubyte.gz")
    x = (torch.from_numpy(images.copy()).float().div_(255.0).sub_(MEAN).div_(STD)).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def cnn_state(width: int = 16, classes: int = 10, seed: int = 0) -> dict[str, Tensor]:
    """The full model's weights: conv1..conv4 (3×3, no bias, [w, 2w, 4w, 8w] channels), bn1..bn4, fc."""
    generator = torch.Generator().manual_seed(seed)
    state, channels = {}, [1, width, 2 * width, 4 * width, 8 * width]
    for i in range(1, 5):
        fan_in = channels[i - 1] * 9
        state[f"conv{i}.weight"] = torch.randn(channels[i], channels[i - 1], 3, 3, generator=generator) / math.sqrt(
            fan_in
        )
        state[f"bn{i}.weight"], state[f"bn{i}.bias"] = torch.ones(channels[i]), torch.zeros(channels[i])
    state["fc.weight"] = torch.randn(classes, channels[4], generator=generator) / math.sqrt(channels[4])
    state["fc.bias"] = torch.zeros(classes)
    return state


def cnn_forward(p: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """conv -> batch norm (batch statistics) -> max-pool -> ReLU for layers 1-3, conv4 -> BN -> ReLU,
    global average pool, fc. A factorized layer ``L`` holds ``L.b.weight`` (1×3) then ``L.a.weight`` (3×1)."""
    for i in range(1, 5):
        if f"conv{i}.weight" in p:
            x = F.conv2d(x, p[f"conv{i}.weight"], padding=1)
        else:
            x = F.conv2d(F.conv2d(x, p[f"conv{i}.b.weight"], padding=(0, 1)), p[f"conv{i}.a.weight"], padding=(1, 0))
        x = F.batch_norm(x, None, None, p[f"bn{i}.weight"], p[f"bn{i}.bias"], training=True)
        x = F.relu(F.max_pool2d(x, 2)) if i < 4 else F.relu(x)
    return F.linear(x.mean((2, 3)), p["fc.weight"], p["fc.bias"])


def level_rank(shape: Sequence[int], gamma: float) -> int | None:
    """A 3×3 conv ``(n, m, 3, 3)``'s rank at γ: ``max(1, round(γ·n))`` half-up, capped at ``3·min(n, m)``;
    None (stays full) at γ = 1 or where the factors would outgrow the layer."""
    n, m, k, _ = shape
    rank = min(max(1, math.floor(gamma * n + 0.5 + 1e-9)), k * min(n, m))
    return None if gamma >= 1 or rank * (n * k + m * k) > n * k * m * k else rank


def svd_of(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``U, S, Vᵀ`` of the unrolled conv weight (:func:`unroll`)."""
    return torch.linalg.svd(unroll(weight), full_matrices=False)


def cut(weight: Tensor, svd: tuple[Tensor, Tensor, Tensor], rank: int) -> tuple[Tensor, Tensor]:
    """The rank-``rank`` pair of a conv ``(n, m, k, k)``: ``b`` ``(r, m, 1, k)``, ``a`` ``(n, r, k, 1)``,
    singular values split evenly (``A = U√S``, ``B = √S Vᵀ``)."""
    n, m, k, _ = weight.shape
    U, S, Vh = svd
    root = S[:rank].sqrt()
    A, B = U[:, :rank] * root, root[:, None] * Vh[:rank]
    return B.reshape(rank, m, 1, k).contiguous(), A.reshape(n, k, rank).permute(0, 2, 1).unsqueeze(-1).contiguous()


def multiply_back(b: Tensor, a: Tensor) -> Tensor:
    """``A B`` folded back to ``(n, m, k, k)``."""
    n, rank, k, _ = a.shape
    m = b.shape[1]
    A = a.squeeze(-1).permute(0, 2, 1).reshape(n * k, rank)
    return (A @ b.reshape(rank, m * k)).reshape(n, k, m, k).permute(0, 2, 1, 3).contiguous()


def level_model(
    state: Mapping[str, Tensor], svds: Mapping[str, tuple[Tensor, Tensor, Tensor]], gamma: float, keep: int = 1
) -> dict[str, Tensor]:
    """The model of level γ: conv2..conv4 past the first ``keep`` of them cut to their rank, the rest as is."""
    out = dict(state)
    for i in range(2 + keep, 5):
        key = f"conv{i}.weight"
        rank = level_rank(state[key].shape, gamma)
        if rank is not None:
            del out[key]
            out[f"conv{i}.b.weight"], out[f"conv{i}.a.weight"] = cut(state[key], svds[key], rank)
    return out


def train_client(
    params: dict[str, Tensor],
    x: Tensor,
    y: Tensor,
    seed: int,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
) -> dict[str, Tensor]:
    """SGD with momentum and weight decay, masked cross-entropy (absent classes' logits 0), batches of one
    skipped; convolutions in ``channels_last`` (PyTorch's layout advice for CNNs on CPU, faster here)."""
    last = torch.channels_last
    params = {
        k: (v.clone(memory_format=last) if v.ndim == 4 else v.clone()).requires_grad_(True) for k, v in params.items()
    }
    opt = torch.optim.SGD(params.values(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    present = torch.bincount(y, minlength=params["fc.bias"].shape[0]) > 0
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            if len(idx) < 2:
                continue
            logits = cnn_forward(params, x[idx].contiguous(memory_format=last))
            loss = F.cross_entropy(logits.masked_fill(~present, 0.0), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return {k: v.detach().contiguous() for k, v in params.items()}


def fedhm_average(
    state: Mapping[str, Tensor], replies: Sequence[tuple[float, Mapping[str, Tensor]]], tau: float = 1.0
) -> dict[str, Tensor]:
    """``Σ_p α_p W_p`` with ``α = softmax(γ/τ)`` over the replies ``(γ_p, state_p)``, factorized layers
    multiplied back first."""
    alpha = torch.softmax(torch.tensor([g / tau for g, _ in replies], dtype=torch.float64), 0)
    out = {}
    for key in state:
        layer = key[: -len(".weight")]
        full = [
            r[key] if key in r else multiply_back(r[f"{layer}.b.weight"], r[f"{layer}.a.weight"]) for _, r in replies
        ]
        out[key] = sum(float(w) * t for w, t in zip(alpha, full))
    return out


#: the data the worker processes read (set before they fork: nothing of it is pickled)
_DATA: dict[str, Any] = {}


def _train_task(task: tuple[dict[str, Tensor], int, int]) -> dict[str, Tensor]:
    params, partition, seed = task
    idx = _DATA["parts"][partition]
    return train_client(params, _DATA["x"][idx], _DATA["y"][idx], seed=seed)


def _eval_task(params: Mapping[str, Tensor]) -> float:
    return accuracy(params, _DATA["x_test"], _DATA["y_test"])


@torch.no_grad()
def accuracy(params: Mapping[str, Tensor], x: Tensor, y: Tensor, batch_size: int = 500) -> float:
    correct = sum(
        int((cnn_forward(params, x[s : s + batch_size]).argmax(1) == y[s : s + batch_size]).sum())
        for s in range(0, len(y), batch_size)
    )
    return correct / len(y)


def whole_job_floor(
    folder: Path,
    partitions: Sequence[Sequence[int]],
    rounds: Sequence[Sequence[tuple[int, float]]],
    levels: Sequence[float],
    width: int = 16,
    seed: int = 0,
    test_examples: int = 0,
    workers: int = 1,
) -> dict[str, Any]:
    """The default FedHM job as a bare loop: per round, each ``(partition, γ)`` trains its level's cut of
    the global model, the server multiplies back and averages, then the global model and each level γ < 1
    are evaluated on the test set (its first ``test_examples``, 0: all). Clients and evaluations run on
    ``workers`` forked processes of one thread each (as the job's Ray workers; 1: in this process).
    Returns the parts' seconds, the accuracies and the final state."""
    t = {"load": 0.0, "train": 0.0, "server": 0.0, "eval": 0.0}
    t0 = time.perf_counter()
    x, y = fashion_mnist(folder, "train")
    x_test, y_test = fashion_mnist(folder, "t10k")
    if test_examples > 0:  # as many as the job's cut test set (not the same ones: the same work)
        x_test, y_test = x_test[:test_examples], y_test[:test_examples]
    _DATA.update(
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        parts=[torch.as_tensor(np.asarray(p, dtype=np.int64)) for p in partitions],
    )
    state = cnn_state(width, seed=seed)
    pool = multiprocessing.get_context("fork").Pool(workers, torch.set_num_threads, (1,)) if workers > 1 else None
    run = pool.map if pool is not None else lambda fn, tasks: list(map(fn, tasks))
    t["load"] = time.perf_counter() - t0
    try:
        accs, state = _rounds(state, rounds, levels, seed, run, t)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return {"seconds": t, "accuracies": accs, "state": state}


def _rounds(
    state: dict[str, Tensor],
    rounds: Sequence[Sequence[tuple[int, float]]],
    levels: Sequence[float],
    seed: int,
    run: Callable[..., list[Any]],
    t: dict[str, float],
) -> tuple[list[list[float]], dict[str, Tensor]]:
    """The rounds; one SVD per factorized layer per model version (the hand-out reuses the evaluation's)."""
    accs, t0 = [], time.perf_counter()
    svds = {k: svd_of(v) for k, v in state.items() if k in ("conv3.weight", "conv4.weight")}
    t["server"] += time.perf_counter() - t0
    for number, sampled in enumerate(rounds, 1):
        t0 = time.perf_counter()
        handed = {g: level_model(state, svds, g) for g in sorted({g for _, g in sampled})}
        t["server"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        trained = run(_train_task, [(handed[g], p, seed * 100003 + number * 1009 + p) for p, g in sampled])
        replies = [(g, r) for (_, g), r in zip(sampled, trained)]
        t["train"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        state = fedhm_average(state, replies)
        svds = {k: svd_of(v) for k, v in state.items() if k in ("conv3.weight", "conv4.weight")}
        models = [state] + [level_model(state, svds, g) for g in levels if g < 1]
        t["server"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        accs.append(run(_eval_task, models))
        t["eval"] += time.perf_counter() - t0
    return accs, state


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.whole_job_floor job.json out.json``: :func:`whole_job_floor` on the job's data (JSON:
    ``folder``, ``partitions``, ``rounds``, ``levels``, ``width``, ``workers``); writes its seconds."""
    started = time.time()
    spec_path, out_path = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    result = whole_job_floor(
        Path(spec["folder"]),
        spec["partitions"],
        spec["rounds"],
        spec["levels"],
        spec["width"],
        test_examples=int(spec.get("test_examples", 0)),
        workers=int(spec["workers"]),
    )
    Path(out_path).write_text(
        json.dumps(
            {
                "seconds": result["seconds"],
                "accuracies": result["accuracies"],
                "main_started_at": started,
                "finished_at": time.time(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
