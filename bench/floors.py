"""The floors the bench divides by: short references in plain torch, written apart from the code
they measure.

Nothing here imports ``fedhm_flwr`` or ``strategies`` (tests/test_bench_floors.py checks the
imports, and that each floor computes what the code it bounds computes). The harnesses
(``bench/server.py``, ``bench/training.py``) hand the floors plain tensors and modules; each report
row names the floor's code path (:func:`where`). Figure 8's bare loop of the whole job is
:mod:`bench.whole_job_floor`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor


def where(fn: Callable) -> str:
    """``bench/floors.py:<line> <name>``: the floor's code path, for the report."""
    line = inspect.getsourcelines(fn)[1]
    return f"bench/{Path(inspect.getsourcefile(fn)).name}:{line} {fn.__name__}"


def unroll(weight: Tensor) -> Tensor:
    """A conv weight ``(n, m, k, k)`` as the matrix ``(n·k, m·k)`` (rows: out channel and kernel
    row; columns: in channel and kernel column); a linear weight as it is."""
    if weight.ndim == 4:
        n, m, k, _ = weight.shape
        return weight.permute(0, 2, 1, 3).reshape(n * k, m * k)
    return weight


def decomposition_floor(weights: Sequence[Tensor], ranks: Sequence[int]) -> list[Tensor]:
    """One float32 ``eigh`` of the smaller Gram matrix per layer; its top ``rank`` eigenvectors."""
    out = []
    for weight, rank in zip(weights, ranks):
        M = unroll(weight.float())
        _, Q = torch.linalg.eigh(M @ M.t() if M.shape[0] <= M.shape[1] else M.t() @ M)
        out.append(Q[:, -rank:])
    return out


def _factor_matrices(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``A (rows × r)``, ``B (r × cols)`` of a factorized layer's wire tensors ``L.a.weight``,
    ``L.b.weight`` (a conv's are ``(n, r, k, 1)`` and ``(r, m, 1, k)``)."""
    if a.ndim == 4:
        n, r, k, _ = a.shape
        return a.squeeze(-1).permute(0, 2, 1).reshape(n * k, r), b.reshape(b.shape[0], -1)
    return a, b


def average_floor(
    previous: Mapping[str, Tensor], replies: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    """``Σ_i w_i W_i`` of hybrid replies: per factorized layer ``L`` (``L.a.weight``/``L.b.weight`` in
    a reply) one product ``[w_1 A_1 | w_2 A_2 | …] @ [B_1; B_2; …]`` plus the weighted sum of the
    replies that sent ``L.weight`` full; every other tensor one weighted sum of the stacked replies
    (``L.a.bias`` counts as ``L.bias``). No per-class rows: the floor is what cannot be avoided."""
    w = torch.as_tensor(list(weights), dtype=torch.float32)
    out: dict[str, Tensor] = {}
    for key, prev in previous.items():
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        factored = [i for i, r in enumerate(replies) if layer is not None and f"{layer}.a.weight" in r]
        if factored:
            pairs = [
                _factor_matrices(replies[i][f"{layer}.a.weight"], replies[i][f"{layer}.b.weight"]) for i in factored
            ]
            total = torch.cat([a * w[i] for (a, _), i in zip(pairs, factored)], 1) @ torch.cat([b for _, b in pairs])
            full = [i for i in range(len(replies)) if i not in factored]
            if full:
                total = total + torch.tensordot(w[full], torch.stack([unroll(replies[i][key]) for i in full]), dims=1)
            if prev.ndim == 4:
                n, m, k, _ = prev.shape
                total = total.reshape(n, k, m, k).permute(0, 2, 1, 3)
            out[key] = total.contiguous()
            continue
        alias = f"{key[: -len('.bias')]}.a.bias" if key.endswith(".bias") else None
        values = [r[key] if key in r else r[alias] for r in replies]
        if prev.is_floating_point():
            out[key] = torch.tensordot(w, torch.stack(values).float(), dims=1).to(prev.dtype)
        else:
            out[key] = torch.tensordot(w.double(), torch.stack(values).double(), dims=1).to(prev.dtype)
    return out


def training_floor(
    model: torch.nn.Module,
    images: Tensor,
    labels: Tensor,
    epochs: int,
    batch_size: int,
    lr: float = 0.01,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    seed: int = 0,
) -> int:
    """Plain SGD with momentum over the examples in shuffled batches of ``batch_size`` (the last one
    kept when it holds two or more), cross-entropy; returns the examples seen."""
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    seen = 0
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), batch_size):
            idx = order[start : start + batch_size]
            if len(idx) < 2:
                continue
            loss = torch.nn.functional.cross_entropy(model(images[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(idx)
    return seen
