"""Adapt a transformer classifier as its spec says: frozen backbone, LoRA, DeMA adapters, full fine-tuning.

Spec keys shared by the transformer archs (``minilm``, ``vit``):

* ``train_backbone`` (bool, default false): full fine-tuning; every tensor is trainable and
  travels. Otherwise the backbone is frozen and loaded by every node itself, and only the
  head and the adapters travel (``model.local_keys`` names the backbone's keys).
* ``lora``: ``{"rank": r}`` puts a rank-``r`` LoRA bypass on Q, K, V and the attention output
  projection of every block; ``{"rank": null}`` a dense ``ΔW`` there (the server's global model).
* ``dema``: ``{"bottleneck": h, "members": [[types in the bank of block 0], ...] | null,
  "own": i | null}`` puts one DeMA adapter after every block (``members`` null: plain adapters,
  the merged deployable model or Homo-Training); see :mod:`fedhm_flwr.models.adapters`.
* ``trainable_only`` (bool): the message carries only the non-backbone tensors; the client loads
  them over its local backbone with :func:`~fedhm_flwr.models.adapters.load_federated` and replies
  with its trainable tensors. Set by the FedLoRA / HeteroTune strategies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .adapters import DeMAAdapter, apply_lora
from .text import MiniLMClassifier, minilm_backbone
from .vit import ViT, vit_backbone


def adapt(model: MiniLMClassifier | ViT, spec: Mapping[str, Any]) -> nn.Module:
    """Freeze / extend ``model`` (built over its backbone, with ``local_keys``) as ``spec`` says."""
    lora, dema = spec.get("lora"), spec.get("dema")
    if lora is not None and dema is not None:
        raise ValueError("model spec: 'lora' and 'dema' are exclusive")
    if bool(spec.get("train_backbone", False)):
        if lora is not None or dema is not None:
            raise ValueError("model spec: train_backbone (full fine-tuning) takes neither 'lora' nor 'dema'")
        model.local_keys = []
        return model
    local = set(model.local_keys)
    for name, p in model.named_parameters():
        if name in local:
            p.requires_grad_(False)
    if lora is not None:
        rank = lora.get("rank")
        apply_lora(model, model.lora_targets(), None if rank is None else int(rank))
    if dema is not None:
        depth = int(model.depth)
        members = dema.get("members") or [[] for _ in range(depth)]
        if len(members) != depth:
            raise ValueError(f"model spec: dema.members has {len(members)} entries for {depth} blocks")
        own = dema.get("own")
        h = int(dema["bottleneck"])
        model.adapters = nn.ModuleList(
            DeMAAdapter(model.block_dim, h, [int(j) for j in m], None if own is None else int(own)) for m in members
        )
    return model


def minilm(spec: Mapping[str, Any]) -> MiniLMClassifier:
    """Registry builder of the MiniLM classifier over its backbone (:mod:`fedhm_flwr.models.text`),
    not adapted yet (:func:`fedhm_flwr.models.build_model` applies :func:`adapt`)."""
    return minilm_backbone(spec)


def vit(spec: Mapping[str, Any]) -> ViT:
    """Registry builder of the small ViT over its backbone (:mod:`fedhm_flwr.models.vit`), not
    adapted yet (:func:`fedhm_flwr.models.build_model` applies :func:`adapt`)."""
    return vit_backbone(spec)


def build_minilm(spec: Mapping[str, Any]) -> nn.Module:
    """The adapted MiniLM classifier (what ``build_model`` gives for ``arch: minilm``)."""
    return adapt(minilm(spec), spec)


def build_vit(spec: Mapping[str, Any]) -> nn.Module:
    """The adapted small ViT (what ``build_model`` gives for ``arch: vit``)."""
    return adapt(vit(spec), spec)
