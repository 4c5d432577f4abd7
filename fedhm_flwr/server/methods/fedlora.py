"""FedLoRA (docs/METHODS.md#fedlora, FedHM journal §5): a frozen pre-trained transformer, heterogeneous LoRA ranks.

The server keeps the full ``ΔW`` of the Q, K, V and output projections of every block (the
global state's ``<layer>.lora_delta``) and the classifier head. A client of level ``γ`` trains
LoRA of rank ``r = max(1, round(γ · method.max_rank))`` (16, 8, 4, 2 for the default levels): it
receives the best rank-``r`` approximation of each ``ΔW`` (one SVD per layer per round, every
rank a truncation of it; components with a ~0 singular value start from seeded random ``A``
rows, the same for every client of the round, and zero ``B`` columns) and the head, and sends
back its ``A``, ``B`` and head. Aggregation: ``ΔW ← Σ_p α_p B_p A_p`` with FedHM's
``α = softmax(γ / τ)`` (optionally times the sample counts); the head is averaged with the same
weights, rows per class. The backbone never travels: every node loads it itself
(``trainable_only`` in the model spec).

``method.mode=full`` is the full fine-tuning baseline: every weight is trained and sent, and the
replies are averaged with the same weights (levels do not change the model then; run it with
``levels.ratios=[1] levels.proportions=[1]``). Homogeneous LoRA at rank ``r``: one level,
e.g. ``levels.ratios=[0.25] levels.proportions=[1]`` for rank 4.

The helpers :func:`transformer_spec` and :func:`type_spec` (backbone references from the run's
``model`` options) are shared with HeteroTune.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.config.options.run import ModelOptions
from fedhm_flwr.config.options.transformer import FedLoRAOptions, TransformerOptions
from fedhm_flwr.math.aggregation import average_states
from fedhm_flwr.math.lora import (
    LORA_DELTA,
    aggregate_products,
    handout_state,
    lora_rank,
    merge_lora_replies,
    random_rows,
)
from fedhm_flwr.math.lowrank import SVD, layer_svd
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import federated_keys
from fedhm_flwr.models.text import PACKAGE_BACKBONE, package_config
from fedhm_flwr.models.vit import DEFAULTS, arch_of, checkpoint_ref
from fedhm_flwr.server.methods.common import class_holds, classifier_keys, gamma_weights
from fedhm_flwr.server.methods.method import Method, Reply, State, method_options

TRANSFORMER_ARCHS = ("minilm", "vit")


# ------------------------------------------------------------------------------------ specs


def transformer_spec(model: ModelOptions, spec: dict[str, Any]) -> dict[str, Any]:
    """The model spec of the run's ``model`` over its backbone (package weights, a ``make pretrain``
    checkpoint named by its cache path, or a seeded random init), without adaptation keys."""
    out = dict(spec)
    backbone = model.backbone
    out["backbone_seed"] = model.backbone_seed
    if spec["arch"] == "minilm":
        for key in ("depth", "heads", "intermediate"):
            value = getattr(model, key)
            if value is not None:
                out[key] = int(value)
        out["backbone"] = PACKAGE_BACKBONE if backbone == "pretrained" else "random"
    elif spec["arch"] == "vit":
        for key in DEFAULTS:
            out[key] = int(getattr(model, key) or DEFAULTS[key])
        out["backbone"] = checkpoint_ref(arch_of(out)) if backbone == "pretrained" else "random"
    else:
        raise ValueError(f"model.arch={spec['arch']!r} is not a transformer; allowed: {list(TRANSFORMER_ARCHS)}")
    return out


def type_spec(spec: dict[str, Any], gamma: float, scale: str) -> dict[str, Any]:
    """The model type of level ``gamma``: ``depth`` → the first ``ceil(γ · depth)`` blocks of the
    same backbone; ``width`` → the pre-trained size of width ``round(γ · width)`` (ViT)."""
    out = dict(spec)
    if scale == "depth":
        full = int(spec.get("depth") or (package_config()["num_hidden_layers"] if spec["arch"] == "minilm" else 4))
        out["depth"] = max(1, math.ceil(gamma * full - 1e-9))
    elif scale == "width":
        if spec["arch"] != "vit":
            raise ValueError("model types by width need model=vit (the packaged MiniLM has one width)")
        out["width"] = max(1, int(math.floor(gamma * int(spec["width"]) + 0.5)))
        if str(spec["backbone"]).startswith("cache:"):
            out["backbone"] = checkpoint_ref(arch_of(out))
    else:
        raise ValueError(f"unknown type scale {scale!r}; allowed: 'depth', 'width'")
    return out


def client_options(opts: RunOptions, server_round: int) -> dict[str, Any]:
    """Train options of the transformer track: ``method.optimizer`` and, when ``method.lr`` is set,
    that learning rate under ``train.lr_schedule`` (``method.lr × schedule(round) / train.lr``)."""
    m = method_options(opts, TransformerOptions)
    out: dict[str, Any] = {"optimizer": m.optimizer}
    if m.lr is not None:
        out["lr"] = m.lr * opts.lr_schedule()(max(1, server_round)) / opts.train.lr
    return out


# ------------------------------------------------------------------------------------ strategy


class _Adaptable(Protocol):
    def lora_targets(self) -> list[str]: ...


class FedLoRA(Method):
    """Levels are LoRA ranks ``max(1, round(γ · max_rank))``; the global model holds the dense ΔW."""

    name = "fedlora"
    options = FedLoRAOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        m = method_options(opts, FedLoRAOptions)
        self.mode = m.mode
        self.max_rank = m.max_rank
        self.tau = m.tau
        self.weight_by_samples = m.weight_by_samples
        self.base_spec = transformer_spec(opts.model, dict(model_spec))
        if self.mode == "full":
            self.spec = {**self.base_spec, "train_backbone": True}
            self.ranks: list[int | None] = [None] * len(self.levels)
        else:
            self.spec = {**self.base_spec, "lora": {"rank": None}, "trainable_only": True}
            self.ranks = [lora_rank(g, self.max_rank) for g in self.levels]
        model = build_model(self.spec)
        # a transformer (ViT, text) whose LoRA targets are linear layers (torch types a module's own
        # attributes as Tensor | Module)
        self.targets = cast(_Adaptable, model).lora_targets()
        self.in_features = {t: cast(nn.Linear, model.get_submodule(t)).in_features for t in self.targets}
        self.max_allowed = min(min(cast(nn.Linear, model.get_submodule(t)).weight.shape) for t in self.targets)
        if self.mode == "lora" and max(cast("list[int]", self.ranks)) > self.max_allowed:  # lora: every rank an int
            raise ValueError(f"method.max_rank={self.max_rank} exceeds the projections' size {self.max_allowed}")
        self.classifier_keys = classifier_keys(model)
        self._round: tuple[int, State, dict[str, SVD], dict[str, torch.Tensor]] | None = None
        self.server_round = 0

    # -- state

    def initial_state(self, seed: int) -> State:
        """``ΔW = 0`` for every target and a seeded head (LoRA), or the whole model (full)."""
        torch.manual_seed(seed)
        model = build_model(self.spec)
        state = model.state_dict()
        keys = federated_keys(model) if self.mode == "lora" else list(state)
        return {k: state[k].detach().clone() for k in keys}

    def level_spec(self, level_index: int) -> dict[str, Any]:
        if self.mode == "full":
            return dict(self.spec)
        return {**self.spec, "lora": {"rank": self.ranks[level_index]}}

    def _prepare(self, server_round: int, global_state: State) -> tuple[dict[str, SVD], dict[str, torch.Tensor]]:
        """One SVD per adapted layer per round, and the round's seeded start rows (shared by all ranks)."""
        cached = self._round
        if cached is None or cached[1] is not global_state:
            gen = torch.Generator().manual_seed(self.opts.seed * 1_000_003 + server_round)
            rows = {t: random_rows(self.max_rank, self.in_features[t], gen) for t in self.targets}
            svds = {t: layer_svd(global_state[f"{t}.{LORA_DELTA}"]) for t in self.targets}
            self._round = cached = (server_round, global_state, svds, rows)
        return cached[2], cached[3]

    def begin_round(self, server_round: int, global_state: State) -> None:
        self.server_round = server_round
        if self.mode == "lora":
            self._prepare(server_round, global_state)

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        options = client_options(self.opts, self.server_round)
        if self.mode == "full":
            return self.level_spec(level_index), dict(global_state), options
        server_round = self._round[0] if self._round is not None and self._round[1] is global_state else 0
        svds, rows = self._prepare(server_round, global_state)
        state = handout_state(global_state, cast(int, self.ranks[level_index]), rows, svds)  # lora: an int
        return self.level_spec(level_index), state, options

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        weights = self.reply_weights(replies)
        holds = class_holds(replies)
        # full-shape keys (the head; every weight in full mode), rows of the head per class
        new = average_states(global_state, [r.state for r in replies], weights, holds, self.classifier_keys)
        if self.mode == "lora":
            new.update(merge_lora_replies(global_state, [r.state for r in replies], weights))
        return new

    def reply_weights(self, replies: list[Reply]) -> np.ndarray:
        """FedHM's ``softmax(γ/τ)`` weights (times the sample counts with ``method.weight_by_samples``)."""
        return gamma_weights(replies, self.tau, self.weight_by_samples)

    def recovered(self, reply: Reply, global_state: State) -> tuple[State, None]:
        """LoRA replies as ``L.lora_delta = B·A`` (full shape) and the head; full mode as it is."""
        if self.mode == "full":
            return dict(reply.state), None
        out = {k: v for k, v in reply.state.items() if not k.endswith((".lora_A", ".lora_B"))}
        for name in self.targets:
            A, B = reply.state[f"{name}.lora_A"], reply.state[f"{name}.lora_B"]
            out[f"{name}.{LORA_DELTA}"] = aggregate_products([(A, B)], [1.0]).to(A.dtype)
        return out, None

    # -- costs

    frozen_backbone = True

    def cost_spec(self, level_index: int) -> dict[str, Any]:
        return self.level_spec(level_index)

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """Trainable parameters (adapters and head apart) and the bytes a client moves per round."""
        return {
            "rank": float(self.ranks[level_index] or 0),
            "params": costs["params"],
            "adapter_params": costs["params"] - costs["head_params"] if self.mode == "lora" else 0.0,
            "head_params": costs["head_params"],
            "frozen_params": costs["frozen_params"],
            "bytes_up": costs["bytes_up"],
            "bytes_down": costs["bytes_up"],  # a client receives exactly the keys it sends back
        }
