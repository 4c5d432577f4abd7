"""Attacks of malicious clients (``failures.attack``): pure functions on tensors, no Flower import.

A malicious client acts on whatever tensors it sends back (so every method is attacked the same
way, in the parametrisation its replies use: FedHM's factors, a width slice, LoRA factors):

* ``scale``: ``received + k · (trained - received)`` (``k`` = ``failures.attack.scale``);
* ``sign_flip``: ``received - (trained - received)``;
* ``gaussian``: ``received + g`` with ``g`` Gaussian noise of the same norm as the honest update
  ``trained - received`` (over all floating tensors sent back), seeded;
* ``label_flip``: trains honestly on flipped labels ``y -> C - 1 - y`` (:class:`LabelFlipped`);
* ``malformed``: trains honestly, then sends a reply malformed in one way (:data:`MALFORMED_KINDS`,
  ``failures.attack.malformed``; the records are made in :mod:`fedhm_flwr.client.hostile`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from fedhm_flwr.core.attack_kinds import KINDS, MALFORMED_KINDS, UPDATE_ATTACKS

__all__ = ["KINDS", "MALFORMED_KINDS", "UPDATE_ATTACKS", "LabelFlipped", "flip_label", "tamper"]


def tamper(
    kind: str, received: Mapping[str, Tensor], trained: Mapping[str, Tensor], scale: float = 100.0, seed: int = 0
) -> dict[str, Tensor]:
    """The tensors a malicious client sends instead of ``trained`` (keys and shapes kept)."""
    if kind not in KINDS:
        raise ValueError(f"attack kind must be one of {list(KINDS)}, got {kind!r}")
    if kind not in UPDATE_ATTACKS:
        return dict(trained)
    trained = {k: v.detach().cpu() for k, v in trained.items()}
    floats = [k for k, v in trained.items() if v.is_floating_point()]
    delta = {k: trained[k].to(torch.float64) - received[k].to(torch.float64) for k in floats}
    if kind == "gaussian":
        generator = torch.Generator().manual_seed(int(seed) % (1 << 63))
        noise = {k: torch.randn(delta[k].shape, generator=generator, dtype=torch.float64) for k in floats}
        norm = torch.sqrt(cast(torch.Tensor, sum((d * d).sum() for d in delta.values())))
        noise_norm = torch.sqrt(cast(torch.Tensor, sum((g * g).sum() for g in noise.values())))
        delta = {k: noise[k] * (norm / noise_norm.clamp_min(1e-300)) for k in floats}
    else:
        factor = float(scale) if kind == "scale" else -1.0
        delta = {k: factor * d for k, d in delta.items()}
    out = dict(trained)
    for k in floats:
        out[k] = (received[k].to(torch.float64) + delta[k]).to(trained[k].dtype)
    return out


def flip_label(y: Any, num_classes: int) -> Any:
    """``C - 1 - y``."""
    return num_classes - 1 - y


class LabelFlipped(torch.utils.data.Dataset[tuple[Any, Any]]):
    """A client dataset whose labels are flipped ``y -> C - 1 - y`` (class counts follow)."""

    def __init__(self, dataset: Any, num_classes: int) -> None:
        self.dataset, self.num_classes = dataset, int(num_classes)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        x, y = self.dataset[index]
        return x, flip_label(y, self.num_classes)

    def class_counts(self) -> np.ndarray:
        return np.asarray(self.dataset.class_counts())[::-1].copy()
