"""PriSM and OrthDrop (docs/METHODS.md#prism): sub-models of principal kernels, sampled per client.

Levels are *keep ratios*: a client of keep ratio ``k`` trains ``ceil(k·R)`` of the ``R`` principal
kernels of every decomposed layer (every factorizable conv / linear layer after the first
``method.rho``; with ``rho = 0``, every conv but the stem, the 1×1 shortcuts and the classifier).
The other layers (stem, shortcuts, norms, classifier, biases) are sent whole.

Server, per round:

1. The global model is kept in factored full-rank form: ``W̄ = U S Vh`` per decomposed layer
   (:mod:`fedhm_flwr.math.prism`). It is the SVD of the float32 global weights, so a resumed run (which
   only has the checkpointed state) recomputes exactly the same form.
2. Per client: ``method.sampling`` picks the kernels: ``prism`` samples without replacement with
   ``p ∝ σ^κ`` (``method.kappa``); ``orthdrop`` takes the top-k (deterministic: OrthDrop, the
   FedHM-like sub-model of the paper's ablation); ``uniform`` and ``softmax`` (``p = softmax(σ)``)
   are the paper's Table 5 ablations. Draws are seeded by (seed, round, partition), so arrival or
   sampling order never matters. With ``method.u_subset`` the client's ``Conv_U`` computes only
   ``r`` of the layer's output channels (``method.u_subset_rows``: the first ``r``, the paper's
   ``u_i(1:r)``, or ``r`` random ones per client and round). The node's draw is remembered in
   ``self.draws[node_id]`` for the round; only ranks (and rows) travel in the model spec.
3. Clients train ``√σ_i u_i``, ``√σ_i v_i`` of their kernels and the unfactorized layers (sBN,
   Frobenius decay on the sampled subset instead of weight decay).
4. Aggregation: every kernel is averaged over the clients that sampled it, unsampled kernels and
   rows nobody computed keep their values; the other parameters are FedAvg'd (sample-count
   weights; classifier rows per class over the clients holding the class). Then the orthogonal
   space refresh: the new weights are re-decomposed. The round returns a full-shape state dict.

A level's *deployable* model (evaluated every round) is its top-k sub-model with every output
row (what a client of that keep ratio could run for inference).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.config.options.factorized import PriSMOptions
from fedhm_flwr.math import prism
from fedhm_flwr.math.aggregation import average_states
from fedhm_flwr.models import build_model, input_shape
from fedhm_flwr.models.costs import activation_elements
from fedhm_flwr.server.methods.common import class_holds, classifier_keys
from fedhm_flwr.server.methods.method import Cut, Method, Reply, State, method_options

#: random-stream id of the kernel draws (the base uses 0: node sampling, 1: levels, 2: failures)
DRAW_STREAM = 3


class _Layered(Protocol):
    """What PriSM reads of its model (the CNN, ResNet and ViT models)."""

    default_rho: int

    def factorizable_layers(self) -> list[str]: ...


class PriSM(Method):
    """Levels are keep ratios; every client trains a sub-model of sampled principal kernels."""

    name = "prism"
    options = PriSMOptions

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        method = method_options(opts, PriSMOptions)
        with torch.device("meta"):  # shapes only
            model = build_model(self.spec, spectral_init=False)
        layered = cast(_Layered, model)  # (torch types a module's own attributes as Tensor | Module)
        rho = int(layered.default_rho) if method.rho is None else int(method.rho)
        self.layers: list[str] = list(layered.factorizable_layers())[rho:]
        self.shapes = {name: tuple(cast(Tensor, model.get_submodule(name).weight).shape) for name in self.layers}
        self.kernels = {name: prism.num_kernels(shape) for name, shape in self.shapes.items()}
        self.counts = [{name: prism.keep_count(R, keep) for name, R in self.kernels.items()} for keep in self.levels]
        self.classifier_keys = classifier_keys(model)
        self.sampling = str(method.sampling)
        self.kappa = float(method.kappa)
        self.u_subset = bool(method.u_subset)
        self.u_rows = str(method.u_subset_rows)
        self.frobenius_decay = bool(method.frobenius_decay)
        self.current_round = 1
        self.factored: dict[str, prism.Factored] = {}
        self._source: dict[str, torch.Tensor] = {}  # the weights self.factored decomposes
        self._probabilities: dict[str, np.ndarray] = {}
        self.draws: dict[int, dict[str, prism.Draw]] = {}  # node id -> its draw, this round

    # ------------------------------------------------------------------ factored form

    def factored_form(self, global_state: State) -> dict[str, prism.Factored]:
        """``U S Vh`` of every decomposed layer of ``global_state`` (recomputed only when the
        weights differ from the ones last decomposed: once per round, by the refresh)."""
        for name in self.layers:
            weight = global_state[f"{name}.weight"]
            source = self._source.get(name)
            if source is None or source.shape != weight.shape or not torch.equal(source, weight):
                self.factored[name] = prism.decompose(weight)
                self._source[name] = weight.detach().clone()
                self._probabilities.pop(name, None)
        return self.factored

    def probabilities(self, name: str) -> np.ndarray:
        """The sampling probabilities of a layer's kernels under the current factored form."""
        if name not in self._probabilities:
            self._probabilities[name] = prism.sampling_probabilities(self.factored[name].S, self.sampling, self.kappa)
        return self._probabilities[name]

    # ------------------------------------------------------------------ draws and payloads

    def _rows(self, name: str, count: int, rng: np.random.Generator | None) -> torch.Tensor | None:
        if not self.u_subset:
            return None
        n = self.shapes[name][0]
        if self.u_rows == "random" and rng is not None:
            return torch.as_tensor(np.sort(rng.choice(n, size=min(count, n), replace=False)), dtype=torch.long)
        return torch.arange(min(count, n))

    def top_k(self, level_index: int, u_subset: bool | None = None) -> dict[str, prism.Draw]:
        """The deterministic draw of a level: the top-k kernels (rows: the first ``r`` with the U-subset)."""
        use_rows = self.u_subset if u_subset is None else u_subset
        out = {}
        for name, count in self.counts[level_index].items():
            rows = torch.arange(min(count, self.shapes[name][0])) if use_rows else None
            out[name] = prism.Draw(prism.draw(self.kernels[name], count, "orthdrop"), rows)
        return out

    def sample(self, server_round: int, partition_key: int, level_index: int) -> dict[str, prism.Draw]:
        """One client's draw: per layer (in a fixed order), kernels then rows, from the client's
        own generator (seed, round, partition)."""
        if self.sampling == "orthdrop" and not (self.u_subset and self.u_rows == "random"):
            return self.top_k(level_index)
        rng = np.random.default_rng([self.opts.seed, int(server_round), DRAW_STREAM, int(partition_key)])
        out = {}
        for name, count in self.counts[level_index].items():
            R = self.kernels[name]
            probs = None if self.sampling == "orthdrop" else self.probabilities(name)
            kernels = prism.draw(R, count, self.sampling, rng, probs)
            out[name] = prism.Draw(kernels, self._rows(name, count, rng))
        return out

    def submodel(self, draws: dict[str, prism.Draw], global_state: State) -> tuple[dict[str, Any], State]:
        """(model spec, state) of the sub-model a draw describes."""
        factored = self.factored_form(global_state)
        state: State = {}
        for key, value in global_state.items():
            layer, _, leaf = key.rpartition(".")
            if layer in draws and leaf == "weight":
                u, v = prism.slice_layer(factored[layer], draws[layer])
                state[f"{layer}.v.weight"], state[f"{layer}.u.weight"] = v, u
            else:  # unfactorized parameters, and the decomposed layers' biases (key L.bias as in the full model)
                state[key] = value
        spec = {**self.spec, "prism": {name: prism.layer_spec(d) for name, d in draws.items()}}
        return spec, state

    def _options(self) -> dict[str, Any]:
        return {"frobenius_decay": self.frobenius_decay}

    # ------------------------------------------------------------------ method hooks

    def begin_round(self, server_round: int, global_state: State) -> None:
        self.current_round = server_round
        self.draws = {}
        self.factored_form(global_state)

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        """A level's representative payload (its top-k draw): what ``inspect`` sizes."""
        spec, state = self.submodel(self.top_k(level_index), global_state)
        return spec, state, self._options()

    def node_cut(self, node_id: int, key: int, level_index: int, global_state: State) -> Cut:
        """The node's own sub-model: its kernels are drawn for it (remembered for :meth:`merge`)."""
        draws = self.sample(self.current_round, key, level_index)
        self.draws[node_id] = draws
        spec, state = self.submodel(draws, global_state)
        return Cut(spec, state, self._options())

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        factored = self.factored_form(global_state)
        counts = np.array([r.num_examples for r in replies], dtype=np.float64)
        holds = class_holds(replies)
        # FedAvg of every parameter sent whole (decomposed layers' weights are absent from the
        # replies and keep their values here; they are replaced below)
        new = average_states(
            global_state, [r.state for r in replies], counts / counts.sum(), holds, self.classifier_keys
        )
        for name in self.layers:
            contributions = []
            for r in replies:
                u, v = prism.reply_factors(r.state[f"{name}.u.weight"], r.state[f"{name}.v.weight"])
                contributions.append((self.draws[r.node_id][name], u, v))
            U, V = prism.aggregate_kernels(factored[name], contributions)
            key = f"{name}.weight"
            new[key] = prism.fold(U @ V, self.shapes[name]).to(global_state[key].dtype)
        self.factored_form(new)  # orthogonal space refresh: re-decompose the new weights
        return new

    def recovered(self, reply: Reply, global_state: State) -> tuple[State, None]:
        """The reply's full-shape model: every decomposed layer ``U'V'`` with the reply's kernels
        (and rows) in place of the server's (:func:`prism.aggregate_kernels` over this one reply),
        the other tensors as sent. Used by the norm filter; PriSM's merge is per kernel, not an
        element-wise mean, so the value defences are refused in the config check."""
        factored = self.factored_form(global_state)
        out = {k: v for k, v in reply.state.items() if not k.endswith((".u.weight", ".v.weight"))}
        for name in self.layers:
            u, v = prism.reply_factors(reply.state[f"{name}.u.weight"], reply.state[f"{name}.v.weight"])
            U, V = prism.aggregate_kernels(factored[name], [(self.draws[reply.node_id][name], u, v)])
            out[f"{name}.weight"] = prism.fold(U @ V, self.shapes[name]).to(torch.float32)
        return out, None

    def deployable(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State]:
        """The level's top-k sub-model with every output row (its best inference model)."""
        return self.submodel(self.top_k(level_index, u_subset=False), global_state)

    def cost_spec(self, level_index: int) -> dict[str, Any]:
        """The level's top-k sub-model (what :meth:`level_payload` sends)."""
        return {**self.spec, "prism": {name: prism.layer_spec(d) for name, d in self.top_k(level_index).items()}}

    def extra_costs(self, level_index: int, model: Any, costs: dict[str, float]) -> dict[str, float]:
        """Also ``activations``: the bytes of activations of one training batch (float32; outputs
        of every leaf module, ``Conv_U``'s counted at the channels it computes)."""
        batch = self.opts.train.batch_size
        return {**costs, "activations": float(4 * batch * activation_elements(model, input_shape(self.spec)))}

    def strategy_state(self) -> dict[str, Any]:
        """Nothing a resume needs: the factored form is the SVD of the checkpointed global weights
        (recomputed bit for bit) and the draws depend only on (seed, round, partition). The
        settings are kept for the record."""
        return {
            "sampling": self.sampling,
            "kappa": self.kappa,
            "u_subset": self.u_subset,
            "u_subset_rows": self.u_rows,
            "layers": self.layers,
        }

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        self.factored, self._source, self._probabilities, self.draws = {}, {}, {}, {}
