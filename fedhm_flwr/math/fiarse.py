"""FIARSE's math (docs/METHODS.md#fiarse): importance-aware extraction by parameter magnitude, the
masked forward of one client step, and the server's update. No Flower.

Wu et al., NeurIPS 2024; the official code is HarliWu/FIARSE (``fiarse/``: ``model/model_utils.py``,
``model/resnet_masked.py``, ``server.py``). What it does, and what is done here:

* **Extraction at size ``s``** (``BetaResNet.generate_mask(s, topk=True)``): the absolute values of
  every weight and bias of every Conv2d and Linear (:func:`masked_keys`; norm layers are not masked),
  concatenated into one vector, give **one global threshold** ``θ``: the ``k``-th largest of them,
  ``k = int(numel · s)`` (here at least 1). A client of size ``s`` trains the elements with
  ``|w| ≥ θ`` (ties at ``θ`` included, as the official ``>=``). :func:`threshold`, :func:`extract`.
* **The masked forward** (``MaskedConv2d`` / ``MaskedLinear``): each forward uses ``w · 1[|w| ≥ θ]``
  with the mask taken on the *current* weights and ``θ`` fixed for the local training. The official
  ``Bern`` function returns a boolean tensor, which autograd does not differentiate, so its written
  backward never runs and the gradient the official code computes is ``g · 1[|w| ≥ θ]``
  (``gradient="masked"``, the default). ``gradient="bern"`` is the backward ``Bern`` is written
  with: ``g · 1[|w| ≥ θ] · (1 + 2θ|w| / (|w| + θ)²)``. :func:`masked_weight`, :func:`train_hook`.
* **The server's update** (``Server.simulation_exp``): each client's update is ``δ_i = sent_i −
  trained_i``; each element becomes ``w − η · Σ_i δ_i / #{i : δ_i ≠ 0}`` (0 where no client changed
  it), ``η`` the server's learning rate (``--lr-global``, 1.0); running statistics take ``η = 1``.
  Plain counts: no sample weights. :func:`aggregate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

#: the gradient rules of the masked weight (see the module docstring)
GRADIENTS = ("masked", "bern")

#: one batch: (x, y, loss(logits, target)) -> (loss, logits)
BatchStep = Callable[[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]], tuple[Tensor, Tensor]]

State = dict[str, Tensor]


def masked_keys(model: nn.Module) -> list[str]:
    """The state keys FIARSE masks: the weight and the bias (where there is one) of every Conv2d and
    Linear, in the model's order (the official masked layers; norms are never masked)."""
    keys = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            prefix = f"{name}." if name else ""
            keys.append(f"{prefix}weight")
            if module.bias is not None:
                keys.append(f"{prefix}bias")
    return keys


def kept_count(numel: int, size: float) -> int:
    """How many of ``numel`` masked elements a size-``size`` sub-model keeps (ties at the threshold
    aside): ``int(numel · size)``, at least 1."""
    if not 0 < size <= 1:
        raise ValueError(f"FIARSE size {size}: a number in (0, 1]")
    return max(1, int(numel * size))


def matched_size(target_params: float, params: int, masked_numel: int) -> float:
    """The size whose sub-model keeps ``target_params`` parameters: the unmasked parameters (norm
    layers) kept whole, the rest of the target from the ``masked_numel`` masked elements; in (0, 1]."""
    size = (target_params - (params - masked_numel)) / masked_numel
    return min(1.0, max(size, 1.0 / masked_numel))


def threshold(state: Mapping[str, Tensor], keys: Sequence[str], size: float) -> float:
    """The global threshold ``θ`` of size ``size``: the ``k``-th largest ``|w|`` over every element
    of ``keys`` together (:func:`kept_count`)."""
    scores = torch.cat([state[k].detach().reshape(-1).float().abs() for k in keys])
    k = kept_count(scores.numel(), size)
    return float(torch.kthvalue(scores, scores.numel() - k + 1).values)


def extract(state: Mapping[str, Tensor], keys: Sequence[str], theta: float) -> State:
    """The sub-model of threshold ``theta``: every tensor of ``state``, those of ``keys`` with the
    elements ``|w| < θ`` set to 0 (what a client receives: full-shape tensors, zeros outside)."""
    masked = set(keys)
    return {k: (v.masked_fill(v.abs() < theta, 0.0) if k in masked else v.clone()) for k, v in state.items()}


def masked_weight(weight: Tensor, theta: float, gradient: str = "masked") -> Tensor:
    """``w · 1[|w| ≥ θ]`` (the mask on the current ``w``, no gradient through it); with
    ``gradient="bern"`` its gradient is ``g · m · (1 + 2θ|w| / (|w| + θ)²)`` (the ``Bern``
    backward as written), the forward value unchanged."""
    mask = weight.detach().abs() >= theta
    if gradient == "masked":
        return weight * mask
    if gradient != "bern":
        raise ValueError(f"fiarse gradient={gradient!r}; allowed: {list(GRADIENTS)}")
    # s has the derivative m·2θ·sign(w)/(|w|+θ)²; s - s.detach() is 0 in the forward
    s = torch.nan_to_num(-2.0 * theta / (weight.abs() + theta)) * mask
    return weight * (mask + (s - s.detach()))


def masked_forward(model: nn.Module, x: Tensor, keys: Sequence[str], theta: float, gradient: str) -> Tensor:
    """``model``'s forward on ``x`` with the parameters of ``keys`` masked (:func:`masked_weight`)."""
    params = dict(model.named_parameters())
    return functional_call(model, {k: masked_weight(params[k], theta, gradient) for k in keys}, (x,))


def train_hook(model: nn.Module, options: Mapping[str, Any], seed: int) -> BatchStep:
    """The client's per-batch step for FIARSE. ``options``: ``threshold`` (``θ`` of the client's size)
    and ``gradient`` (one of :data:`GRADIENTS`). The masked keys are the model's own
    (:func:`masked_keys`); the mask is taken again on every forward, ``θ`` fixed."""
    theta, gradient = float(options["threshold"]), str(options.get("gradient", "masked"))
    if gradient not in GRADIENTS:
        raise ValueError(f"fiarse hook: gradient={gradient!r}; allowed: {list(GRADIENTS)}")
    keys = masked_keys(model)

    def step(x: Tensor, y: Tensor, loss: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        logits = masked_forward(model, x, keys, theta, gradient)
        return loss(logits, y), logits

    return step


def aggregate(
    global_state: Mapping[str, Tensor],
    sent: Sequence[Mapping[str, Tensor]],
    trained: Sequence[Mapping[str, Tensor]],
    lr: float,
) -> State:
    """The server's update: per element ``w − lr · Σ_i δ_i / #{i : δ_i ≠ 0}`` with ``δ_i = sent_i −
    trained_i`` (0 where no ``δ_i`` is), over the clients in order; running statistics with lr 1,
    integer tensors kept as they are."""
    if len(sent) != len(trained):
        raise ValueError(f"{len(sent)} sent states for {len(trained)} replies")
    out = {}
    for key, value in global_state.items():
        if not value.is_floating_point() or not trained:
            out[key] = value.clone()
            continue
        total = torch.zeros_like(value)
        count = torch.zeros_like(value)
        for s, t in zip(sent, trained):
            delta = s[key].to(value.dtype) - t[key].to(value.dtype)
            total += delta
            count += delta != 0
        step = torch.nan_to_num(total / count, nan=0.0, posinf=0.0, neginf=0.0)
        rate = 1.0 if ("running_mean" in key or "running_var" in key) else lr
        out[key] = value - rate * step
    return out
