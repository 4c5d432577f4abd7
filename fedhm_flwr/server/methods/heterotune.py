"""HeteroTune (docs/METHODS.md#heterotune): model types of different sizes, DeMA adapters, CMGA on the server.

Level ``i`` is model type ``i`` (largest first). A type is the transformer backbone truncated to
``ceil(γ_i · depth)`` blocks (``method.scale=depth``; MiniLM) or the pre-trained ViT of width
``round(γ_i · width)`` (``method.scale=width``); ``auto`` picks depth for MiniLM, width for ViT.
Every block of every type carries a DeMA adapter with the common bottleneck ``h``; block ``k`` of
every type that has it is *slot* ``k``, and the bank of slot ``k`` holds the share-adapter pair
of each type that has that slot.

Global state (server):

* ``type<i>.adapters.<k>.{down,up}.*``, ``type<i>.adapters.<k>.gate_{pre,post}``, ``type<i>.head.*``:
  each type's local adapters, gates and head;
* ``adapters.<k>.share_{pre,post}.<j>``: the one copy of every share-adapter.

A type-``i`` client receives its type's tensors and the bank of each of its slots, trains its
local adapters, gates, head and only ``share_*.<i>`` (the others are used, frozen) and sends back
what it trained. Merge: the local adapters, gates and heads are averaged within each type
(sample-count weights; head rows per class). The share-adapters: per slot, the update of type
``i``'s pair, ``Δ_i`` = (its clients' sample-weighted mean) − (the global pair), flattened
(pre and post together), is stacked as column ``i`` of ``G``; with CMGA ``G̃ = c·G(GᵀG + εI)^(-1/2)``
(:func:`fedhm_flwr.math.cmga.cmga`, ``c = ‖G‖_F/√N`` by default) and ``S_i ← S_i + G̃[:, i]``; without
CMGA ``S_i ← S_i + Δ_i``. Only the types that trained that slot this round are columns of ``G``
(a type absent from the round keeps its share-adapters; a zero column would only shrink the
others).

Evaluation: each type's deployable model is its DeMA merged exactly into plain adapters
(:func:`fedhm_flwr.models.adapters.merge_dema`); ``global`` is the largest type.

Baselines: ``method.cmga=false`` (HeteroTune without CMGA); ``method.bank=false`` (no
share-adapters: plain adapters averaged within each type, i.e. Homo-Training); AllSmall /
AllLarge: one level, e.g. ``levels.ratios=[0.25] levels.proportions=[1]`` (the small type
only) or ``levels.ratios=[1] levels.proportions=[1]``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.config.options.transformer import HeteroTuneOptions
from fedhm_flwr.math.aggregation import average_states
from fedhm_flwr.math.cmga import cmga
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import federated_keys, merge_dema
from fedhm_flwr.models.text import package_config
from fedhm_flwr.server.methods.common import class_holds, classifier_keys, record_bytes
from fedhm_flwr.server.methods.fedlora import client_options, transformer_spec, type_spec
from fedhm_flwr.server.methods.method import Method, Reply, State, method_options

SITES = ("pre", "post")


def type_prefix(i: int) -> str:
    return f"type{i}."


def is_share(key: str) -> bool:
    return ".share_pre." in key or ".share_post." in key


def slot_of(key: str) -> int:
    """``adapters.<k>....`` -> k."""
    return int(key.split(".")[1])


class HeteroTune(Method):
    """Levels are model types (largest first); DeMA adapters with a share-adapter bank; CMGA."""

    name = "heterotune"
    options = HeteroTuneOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        m = method_options(opts, HeteroTuneOptions)
        self.h = m.bottleneck
        self.bank = m.bank
        self.use_cmga = m.cmga and self.bank
        self.cmga_eps = m.cmga_eps
        self.cmga_scale = m.cmga_scale
        base = transformer_spec(opts.model, dict(model_spec))
        scale = m.scale
        if scale == "auto":
            scale = "depth" if base["arch"] == "minilm" else "width"
        self.scale = scale
        self.type_specs = [type_spec(base, g, scale) for g in self.levels]
        self.depths = [self._depth(s) for s in self.type_specs]
        #: slot k -> the types that have block k
        self.members = [[j for j, d in enumerate(self.depths) if d > k] for k in range(max(self.depths))]
        self.spec = self.deploy_spec(0)
        probe = build_model(self.deploy_spec(0))
        self.classifier_keys = classifier_keys(probe)
        self.server_round = 0

    @staticmethod
    def _depth(spec: dict[str, Any]) -> int:
        if spec.get("depth"):
            return int(spec["depth"])
        return int(package_config()["num_hidden_layers"])

    # -- specs

    def train_spec(self, i: int) -> dict[str, Any]:
        """Type ``i``'s training model: DeMA with the bank of each of its slots, own share ``i``."""
        members = [self.members[k] if self.bank else [] for k in range(self.depths[i])]
        return {
            **self.type_specs[i],
            "dema": {"bottleneck": self.h, "members": members, "own": i if self.bank else None},
            "trainable_only": True,
        }

    def deploy_spec(self, i: int) -> dict[str, Any]:
        """Type ``i``'s deployable model: plain adapters (the bank merged in)."""
        return {
            **self.type_specs[i],
            "dema": {"bottleneck": self.h, "members": None, "own": None},
            "trainable_only": True,
        }

    # -- state

    def initial_state(self, seed: int) -> State:
        torch.manual_seed(seed)
        out: State = {}
        for i in range(len(self.levels)):
            model = build_model(self.train_spec(i))
            state = model.state_dict()
            for key in federated_keys(model):
                if is_share(key):
                    out.setdefault(key, state[key].detach().clone())  # zero-initialised, one copy
                else:
                    out[type_prefix(i) + key] = state[key].detach().clone()
        return out

    def begin_round(self, server_round: int, global_state: State) -> None:
        self.server_round = server_round

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        i, prefix = level_index, type_prefix(level_index)
        state = {k[len(prefix) :]: v for k, v in global_state.items() if k.startswith(prefix)}
        if self.bank:
            for k in range(self.depths[i]):
                for j in self.members[k]:
                    for site in SITES:
                        key = f"adapters.{k}.share_{site}.{j}"
                        state[key] = global_state[key]
        return self.train_spec(i), state, client_options(self.opts, self.server_round)

    def reply_keys(self, level_index: int, spec: dict[str, Any], state: State) -> list[str]:
        """Everything received but the other types' (frozen) share-adapters."""
        own = str(level_index)
        return [k for k in state if not is_share(k) or k.rsplit(".", 1)[1] == own]

    def deployable(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State]:
        """Type ``i`` with its bank merged exactly into its local adapters (gates included)."""
        _, state, _ = self.level_payload(level_index, global_state)
        out = {k: v for k, v in state.items() if not k.startswith("adapters.")}
        for k in range(self.depths[level_index]):
            prefix = f"adapters.{k}."
            local = {key[len(prefix) :]: v for key, v in state.items() if key.startswith(prefix)}
            merged = merge_dema(local, self.members[k] if self.bank else [])
            out.update({prefix + key: v for key, v in merged.items()})
        return self.deploy_spec(level_index), out

    def global_model(self, global_state: State) -> tuple[dict[str, Any], State]:
        return self.deployable(0, global_state)

    # -- merge

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        new = dict(global_state)
        by_type: dict[int, list[Reply]] = defaultdict(list)
        for r in replies:
            by_type[r.level_index].append(r)
        share_means: dict[int, dict[str, torch.Tensor]] = {}
        for i, group in sorted(by_type.items()):
            n = np.array([r.num_examples for r in group], dtype=np.float64)
            w = n / n.sum()
            prefix = type_prefix(i)
            local_keys = [k for k in group[0].state if not is_share(k)]
            previous = {k: global_state[prefix + k] for k in local_keys}
            holds = class_holds(group)
            averaged = average_states(previous, [r.state for r in group], w, holds, self.classifier_keys)
            new.update({prefix + k: v for k, v in averaged.items()})
            shares = [k for k in group[0].state if is_share(k)]
            share_means[i] = {
                k: torch.tensordot(
                    torch.as_tensor(w), torch.stack([r.state[k].to(torch.float64) for r in group]), dims=1
                )
                for k in shares
            }
        if self.bank:
            new.update(self._merge_shares(global_state, share_means))
        return new

    def recovered(self, reply: Reply, global_state: State) -> tuple[State, None]:
        """The reply under the global state's names (its type's tensors and its own share-adapters;
        the rest of the global state is not covered). Used by the norm filter; CMGA is not an
        element-wise mean, so the value defences are refused in the config check."""
        prefix = type_prefix(reply.level_index)
        return {(k if is_share(k) else prefix + k): v for k, v in reply.state.items()}, None

    def _merge_shares(self, global_state: State, means: dict[int, dict[str, torch.Tensor]]) -> State:
        """Per slot: Δ_i of every type that trained it, CMGA across types, S_i ← S_i + G̃[:, i]."""
        out: State = {}
        for k, members in enumerate(self.members):
            present = [i for i in members if i in means]
            if not present:
                continue
            keys = {i: [f"adapters.{k}.share_{site}.{i}" for site in SITES] for i in present}
            deltas = [
                torch.cat([(means[i][key] - global_state[key].to(torch.float64)).flatten() for key in keys[i]])
                for i in present
            ]
            G = torch.stack(deltas, dim=1)
            G_new = cmga(G, self.cmga_scale, self.cmga_eps) if self.use_cmga else G
            for col, i in enumerate(present):
                offset = 0
                for key in keys[i]:
                    prev = global_state[key]
                    size = prev.numel()
                    out[key] = (prev.to(torch.float64) + G_new[offset : offset + size, col].view_as(prev)).to(
                        prev.dtype
                    )
                    offset += size
        return out

    # -- costs

    frozen_backbone = True

    def cost_spec(self, level_index: int) -> dict[str, Any]:
        return self.train_spec(level_index)

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """Per type: trainable parameters (adapters, gates, own share-adapters, head) and bytes moved."""
        i = level_index
        share = sum(p.numel() for k, p in model.named_parameters() if p.requires_grad and is_share(k))
        received = {k: v for k, v in model.state_dict().items() if k in set(federated_keys(model))}
        deployed = build_model(self.deploy_spec(i))
        spec = self.type_specs[i]
        return {
            "depth": float(self.depths[i]),
            "width": float(spec.get("width") or model.block_dim),
            "params": costs["params"],
            "adapter_params": costs["params"] - costs["head_params"] - float(share),
            "share_params": float(share),
            "head_params": costs["head_params"],
            "frozen_params": costs["frozen_params"],
            "deployed_adapter_params": float(
                sum(p.numel() for n, p in deployed.named_parameters() if n.startswith("adapters."))
            ),
            "bytes_up": costs["bytes_up"],
            "bytes_down": float(record_bytes(received)),
        }
