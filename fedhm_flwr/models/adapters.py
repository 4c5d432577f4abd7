"""Parameter-efficient modules for the transformer track: LoRA bypasses and DeMA adapters.

LoRA (docs/METHODS.md#fedlora): :class:`LoRALinear` is an ``nn.Linear`` whose frozen ``weight``/``bias``
keep their names (so pre-trained checkpoints load unchanged) plus either a rank-``r`` bypass
``lora_B (out × r) @ lora_A (r × in)`` (a client's model) or a dense ``lora_delta (out × in)``
(the server's global model): ``y = x (W0 + ΔW)ᵀ + b``, scale 1.

DeMA (docs/METHODS.md#heterotune): :class:`DeMAAdapter` with the local adapter ``down`` (``h × d``),
``up`` (``d × h``, zero-initialised), a bank of square share-adapters ``share_pre[j]``,
``share_post[j]`` (``h × h``, zero-initialised, one pair per model type ``j`` present at this
slot) and input-independent gates ``gate_pre``, ``gate_post`` (softmax over the bank):

    z = M_pre (W_down x + b_d),   a = M_post σ(z),   adapter(x) = W_up a + b_u,
    M = I + Σ_j softmax(g)_j S_j.

A type-``i`` model trains ``down``, ``up``, the gates and only ``share_*[i]``; the other
share-adapters are used but frozen. :func:`merge_dema` absorbs the bank exactly
(``W_down' = M_pre W_down``, ``b_d' = M_pre b_d``, ``W_up' = W_up M_post``) into a plain adapter
(a DeMAAdapter with an empty bank). The adapter's output is added to its block's output.

Federated state: a model built over a frozen backbone records in ``model.local_keys`` the state
keys that every node loads by itself (the pre-trained checkpoint, or a seeded random init); those
never travel. :func:`load_federated` loads a received state after checking that its keys are
exactly the others, :func:`trainable_state` is what a client sends back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DeMAAdapter",
    "LoRALinear",
    "apply_lora",
    "federated_keys",
    "gate_weights",
    "load_federated",
    "merge_dema",
    "mixing_matrix",
    "trainable_state",
]


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a LoRA bypass: rank ``r`` (``lora_A``, ``lora_B``) or dense (``lora_delta``).

    ``weight`` and ``bias`` are the frozen pre-trained ones (same state keys as the plain layer).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, rank: int | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._add_bypass(rank)

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int | None) -> LoRALinear:
        """A LoRALinear sharing ``linear``'s weight and bias tensors."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._add_bypass(rank)
        return new

    def _add_bypass(self, rank: int | None) -> None:
        self.rank = rank
        ref = self.weight
        kw: dict[str, Any] = {"dtype": ref.dtype, "device": ref.device}
        if rank is None:  # dense ΔW
            self.lora_delta = nn.Parameter(torch.zeros(self.out_features, self.in_features, **kw))
            return
        if not 1 <= rank <= min(self.in_features, self.out_features):
            raise ValueError(f"LoRA rank must be in [1, {min(self.in_features, self.out_features)}], got {rank}")
        bound = 1.0 / math.sqrt(self.in_features)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.rank is None:
            return y + F.linear(x, self.lora_delta)
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={'dense' if self.rank is None else self.rank}"


def apply_lora(model: nn.Module, names: Sequence[str], rank: int | None) -> None:
    """Replace each ``nn.Linear`` named in ``names`` by a :class:`LoRALinear` (in place)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is not an nn.Linear ({type(linear).__name__})")
        setattr(parent, child, LoRALinear.wrap(linear, rank))


# --------------------------------------------------------------------------------------------
# DeMA
# --------------------------------------------------------------------------------------------


def gate_weights(gate: Tensor) -> Tensor:
    """``softmax(g)``: the bank's input-independent mixing weights."""
    return torch.softmax(gate, dim=0)


def mixing_matrix(gate: Tensor, shares: Sequence[Tensor]) -> Tensor:
    """``M = I + Σ_j softmax(g)_j S_j``."""
    if len(shares) != gate.numel():
        raise ValueError(f"{gate.numel()} gates for {len(shares)} share-adapters")
    h = shares[0].shape[0]
    alpha = gate_weights(gate)
    M = torch.eye(h, dtype=shares[0].dtype, device=shares[0].device)
    for a, S in zip(alpha, shares):
        M = M + a * S
    return M


class DeMAAdapter(nn.Module):
    """One DeMA adapter (see the module docstring); ``members`` = model types in the bank.

    ``members=()`` gives a plain adapter (the merged deployable model, or Homo-Training).
    ``own`` is the type whose share-adapters this model trains (the others are frozen).
    """

    def __init__(self, dim: int, bottleneck: int, members: Sequence[int] = (), own: int | None = None) -> None:
        super().__init__()
        self.members = [int(j) for j in members]
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"bank members must be distinct, got {self.members}")
        if self.members and own is not None and own not in self.members:
            raise ValueError(f"own type {own} is not in the bank {self.members}")
        self.own = own
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        if self.members:
            self.share_pre = nn.ParameterDict(
                {str(j): nn.Parameter(torch.zeros(bottleneck, bottleneck)) for j in self.members}
            )
            self.share_post = nn.ParameterDict(
                {str(j): nn.Parameter(torch.zeros(bottleneck, bottleneck)) for j in self.members}
            )
            self.gate_pre = nn.Parameter(torch.zeros(len(self.members)))
            self.gate_post = nn.Parameter(torch.zeros(len(self.members)))
            for j in self.members:
                if j != own:
                    self.share_pre[str(j)].requires_grad_(False)
                    self.share_post[str(j)].requires_grad_(False)

    def mixing(self) -> tuple[Tensor, Tensor] | None:
        """``(M_pre, M_post)``, or None for a plain adapter."""
        if not self.members:
            return None
        pre = [self.share_pre[str(j)] for j in self.members]
        post = [self.share_post[str(j)] for j in self.members]
        return mixing_matrix(self.gate_pre, pre), mixing_matrix(self.gate_post, post)

    def forward(self, x: Tensor) -> Tensor:
        z = self.down(x)
        mix = self.mixing()
        if mix is None:
            return self.up(F.gelu(z))
        M_pre, M_post = mix
        a = F.gelu(z @ M_pre.T) @ M_post.T
        return self.up(a)


def merge_dema(tensors: Mapping[str, Tensor], members: Sequence[int]) -> dict[str, Tensor]:
    """Absorb one adapter's bank into its local adapter, exactly.

    ``tensors`` holds one adapter's state (keys ``down.weight``, ``down.bias``, ``up.weight``,
    ``up.bias``, ``share_pre.<j>``, ``share_post.<j>``, ``gate_pre``, ``gate_post``); returns the
    plain adapter's ``down.*``/``up.*`` with ``W_down' = M_pre W_down``, ``b_d' = M_pre b_d``,
    ``W_up' = W_up M_post`` (computed in float64, returned in the input dtype).
    """
    dtype = tensors["down.weight"].dtype
    t = {k: v.to(torch.float64) for k, v in tensors.items()}
    if not members:
        return {k: tensors[k] for k in ("down.weight", "down.bias", "up.weight", "up.bias")}
    M_pre = mixing_matrix(t["gate_pre"], [t[f"share_pre.{j}"] for j in members])
    M_post = mixing_matrix(t["gate_post"], [t[f"share_post.{j}"] for j in members])
    return {
        "down.weight": (M_pre @ t["down.weight"]).to(dtype),
        "down.bias": (M_pre @ t["down.bias"]).to(dtype),
        "up.weight": (t["up.weight"] @ M_post).to(dtype),
        "up.bias": tensors["up.bias"],
    }


# --------------------------------------------------------------------------------------------
# Federated state over a locally loaded backbone
# --------------------------------------------------------------------------------------------


def federated_keys(model: nn.Module) -> list[str]:
    """State keys that travel: all but the locally loaded backbone's (``model.local_keys``)."""
    local = set(getattr(model, "local_keys", ()))
    return [k for k in model.state_dict() if k not in local]


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """The parameters a client trained (``requires_grad``), detached on the CPU: its reply."""
    return {k: p.detach().cpu() for k, p in model.named_parameters() if p.requires_grad}


def load_federated(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Load a received state over the locally loaded backbone.

    The received keys must be exactly :func:`federated_keys` (ValueError naming the missing and
    unexpected ones otherwise: a backbone tensor sent by mistake, or a missing adapter); shapes
    are checked by ``load_state_dict``.
    """
    expected = set(federated_keys(model))
    got = set(state)
    if expected != got:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise ValueError(
            f"received keys are not the model's federated keys: missing {missing[:4]}"
            f"{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}"
        )
    result = model.load_state_dict(dict(state), strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
