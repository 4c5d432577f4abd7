"""FjORD's client side (docs/METHODS.md#fjord): ordered dropout, a nested width drawn per batch. No Flower.

A client of level ``p_max`` receives its width-``p_max`` slice of the global model (HeteroFL's
static slice, :mod:`fedhm_flwr.math.width`). For every batch it draws ``p`` uniformly from the
allowed widths ``{p ∈ P : p ≤ p_max}`` and trains the width-``p`` sub-model: the first
``ceil(p·C)`` channels of every hidden layer, as the ``p_max`` model's parameters narrowed to
those sizes. The narrowed tensors are views, so the gradients land in the first channels of the
``p_max`` parameters and the optimizer steps the ``p_max`` model (elements outside the slice get
a zero gradient: weight decay and momentum still act on them, as on the reference's full model).

The sizes of each width's tensors come in the message (``sizes``: one ``{key: shape}`` per
allowed ``p``, from the server's index plans), so the client builds no second model: the
received model's forward is run with the narrowed tensors (``torch.func.functional_call``),
which computes the width-``p`` sub-model exactly when the forward reads its widths from the
tensors, as the built-in conv nets do (conv, static batch norm, pooling, linear).

Knowledge distillation (``distill``, the reference's ``fjord_kd``): the ``p_max`` model's output
on the batch is trained on the labels, and the sampled width is trained on the ``p_max`` model's
softmax (detached) instead of the labels; the loss is the sum of both.

The client loop (:func:`fedhm_flwr.math.train.train_local`) finds this module's
:func:`train_hook` by the ``hook`` train option ``"fjord"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

#: one batch: (x, y, loss(logits, target)) -> (loss, logits)
BatchStep = Callable[[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]], tuple[Tensor, Tensor]]


def narrowed(tensors: Mapping[str, Tensor], sizes: Mapping[str, Sequence[int]]) -> dict[str, Tensor]:
    """Every tensor cut to its first ``sizes[key][d]`` entries along each dimension ``d``: views
    (``Tensor.narrow``), so gradients flow back into the whole tensor. A key ``sizes`` lacks, a
    size of the wrong rank or one beyond the tensor is refused."""
    out = {}
    for key, tensor in tensors.items():
        if key not in sizes:
            raise KeyError(f"the width sizes have no entry for {key!r}")
        size = [int(s) for s in sizes[key]]
        if len(size) != tensor.dim() or any(not 1 <= s <= n for s, n in zip(size, tensor.shape)):
            raise ValueError(f"{key}: width size {size} does not fit a tensor of shape {tuple(tensor.shape)}")
        view = tensor
        for d, s in enumerate(size):
            if s != tensor.shape[d]:
                view = view.narrow(d, 0, s)
        out[key] = view
    return out


def allowed_widths(p_values: Sequence[float], p_max: float) -> list[float]:
    """The widths a client of level ``p_max`` draws from: ``{p ∈ P : p ≤ p_max}``, ascending."""
    allowed = sorted({float(p) for p in p_values if float(p) <= float(p_max) + 1e-12})
    if not allowed:
        raise ValueError(f"no width of {list(p_values)} is <= p_max={p_max}")
    return allowed


def draw_width(count: int, generator: torch.Generator) -> int:
    """The index of the width a batch trains: uniform over ``count`` widths."""
    return int(torch.randint(count, (1,), generator=generator))


def width_forward(model: nn.Module, x: Tensor, sizes: Mapping[str, Sequence[int]]) -> Tensor:
    """``model``'s forward on ``x`` with its parameters and buffers narrowed to ``sizes``."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return functional_call(model, narrowed(tensors, sizes), (x,))


def fjord_step(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor],
    sizes: Mapping[str, Sequence[int]],
    distill: bool,
) -> tuple[Tensor, Tensor]:
    """One batch of FjORD: (loss, logits of the sampled width ``sizes``). With ``distill``, the
    full received model (``p_max``) learns the labels and the sampled width its detached softmax."""
    if not distill:
        logits = width_forward(model, x, sizes)
        return loss(logits, y), logits
    full = model(x)
    full_loss = loss(full, y)
    logits = width_forward(model, x, sizes)
    return full_loss + loss(logits, full.detach().softmax(dim=1)), logits


def train_hook(model: nn.Module, options: Mapping[str, Any], seed: int) -> BatchStep:
    """The client's per-batch step for FjORD. ``options``: ``p_values`` (the allowed widths, one
    per entry of ``sizes``), ``sizes`` (per width, ``{state key: shape}``), ``distill``. The
    widths are drawn from their own generator seeded by ``seed`` (the batches' order is the
    loader's, unchanged)."""
    p_values, sizes = list(options["p_values"]), list(options["sizes"])
    if not p_values or len(p_values) != len(sizes):
        raise ValueError(f"fjord hook: need one sizes entry per width, got {len(p_values)} widths, {len(sizes)} sizes")
    generator = torch.Generator().manual_seed(int(seed))
    distill = bool(options.get("distill", False))

    def step(x: Tensor, y: Tensor, loss: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        return fjord_step(model, x, y, loss, sizes[draw_width(len(p_values), generator)], distill)

    return step
