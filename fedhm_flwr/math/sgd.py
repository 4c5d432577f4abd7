"""SGD with momentum for the local training loop on a CPU, without ``torch.optim``'s wrappers. No Flower import.

``torch.optim.Optimizer.step`` and ``zero_grad`` import ``torch._dynamo`` at their first call (for
``torch.compile``), about 1.5 s of CPU in every process that trains: every simulated client actor,
and on a SuperNode every ClientApp process, one per message. :class:`MomentumSGD` is
``torch.optim.SGD(groups, lr=lr, momentum=momentum)`` for what the loop uses of it (``zero_grad(set_to_none)``
and ``step``), the same arithmetic in the same order as torch's single-tensor SGD, the one it runs on a
CPU (it runs the multi-tensor one on accelerators): per parameter with a gradient, the group's weight
decay added to the gradient (``g + wd * p``), the momentum buffer set to a copy of that gradient at the
first step and ``buf * momentum + g`` after (no dampening, no Nesterov), then ``p - lr * buf``. Its
updates are equal to ``torch.optim.SGD``'s bit for bit (tests/test_sgd.py); :func:`make_sgd` uses it on
a CPU and ``torch.optim.SGD`` elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class MomentumSGD:
    """``torch.optim.SGD(groups, lr=lr, momentum=momentum)`` on a CPU (see the module docstring)."""

    def __init__(self, groups: Sequence[dict[str, Any]], lr: float, momentum: float) -> None:
        self.groups = [(list(g["params"]), float(g.get("weight_decay", 0.0))) for g in groups]
        self.lr, self.momentum = float(lr), float(momentum)
        self.buffers: dict[int, torch.Tensor] = {}  # id(parameter) -> its momentum buffer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient to None (``set_to_none=True``, the loop's call, torch's default)."""
        if not set_to_none:
            raise ValueError("MomentumSGD.zero_grad: set_to_none=False is not supported")
        for params, _ in self.groups:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for params, weight_decay in self.groups:
            for p in params:
                if p.grad is None:
                    continue
                grad = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
                if self.momentum != 0:
                    buf = self.buffers.get(id(p))
                    if buf is None:
                        buf = self.buffers[id(p)] = grad.detach().clone()
                    else:
                        buf.mul_(self.momentum).add_(grad, alpha=1)
                    grad = buf
                p.add_(grad, alpha=-self.lr)


def make_sgd(
    groups: Sequence[dict[str, Any]], lr: float, momentum: float, device: torch.device
) -> MomentumSGD | torch.optim.SGD:
    """The loop's SGD: :class:`MomentumSGD` on a CPU, ``torch.optim.SGD`` (its multi-tensor path) elsewhere."""
    if device.type == "cpu":
        return MomentumSGD(groups, lr, momentum)
    return torch.optim.SGD(list(groups), lr=lr, momentum=momentum)
