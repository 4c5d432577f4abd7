"""FjORD (docs/METHODS.md#fjord): ordered dropout, nested widths drawn per batch up to a client's p_max.

Horváth et al., NeurIPS 2021; Flower's ``baselines/fjord`` is the reference implementation. A level
is a client's largest width ``p_max``; its clients receive the width-``p_max`` slice of the global
model (HeteroFL's static slice: the first ``ceil(p·C)`` channels of every hidden layer, the stem's
input and the classifier's outputs whole; no Scaler) and, for every batch, train the width-``p``
sub-model of it for a ``p`` drawn uniformly from ``{p ∈ P : p ≤ p_max}`` (the client hook
:mod:`fedhm_flwr.math.fjord`, named in the train options with the sizes of each width's tensors).
``P`` is ``method.p_values`` (null: the levels' widths); every level is one of them.

Aggregation is HeteroFL's element-wise mean over the clients whose ``p_max`` slice holds the
element (:func:`fedhm_flwr.math.width.aggregate`), weighted by sample counts as the reference
does (``method.weight_by_samples``); elements nobody holds keep their values. Because every
``p_max`` is in ``P`` and the slices are nested, this is the reference's nested average
(each ``[:ceil(p·C_out), :ceil(p·C_in)]`` block over the clients with ``p_max ≥ p``).
Classifier rows are averaged over the clients holding the class, as for every method here (with
every class held: the reference's average). A level's deployable model is its ``p_max`` slice.
"""

from __future__ import annotations

from typing import Any

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.config.options.width import FjORDOptions
from fedhm_flwr.math import fjord, width
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.method import State, method_options


class FjORD(HeteroFL):
    """HeteroFL's slices and aggregation; the clients draw a nested width per batch."""

    name = "fjord"
    options = FjORDOptions
    reads = FjORDOptions
    mode = "static"

    def __init__(self, opts: RunOptions, model_spec: dict[str, Any]) -> None:
        super().__init__(opts, model_spec)
        m = method_options(opts, FjORDOptions)
        self.scaler = False  # one model trains several widths: no per-rate Scaler
        p_values = m.p_values
        #: the widths P drawn per batch, ascending (null: the levels' widths, matched ones included)
        self.p_values = sorted({float(p) for p in (self.rates if p_values is None else p_values)})
        missing = [r for r in self.rates if r not in self.p_values]
        if missing:
            raise ValueError(f"method.p_values {self.p_values} lacks the level widths {missing}")
        self.distill = m.distill
        self._width_plans: dict[float, width.Plan] = {}

    def width_plan(self, p: float) -> width.Plan:
        """The static index plan of width ``p`` (cached)."""
        if p not in self._width_plans:
            self._width_plans[p] = width.index_plan(self._shapes_model, p, "static")
        return self._width_plans[p]

    def hook_options(self, level_index: int, keys: list[str]) -> dict[str, Any]:
        """What a client of the level needs to draw its widths: the allowed widths and, for each,
        the shape of every tensor of ``keys`` (the width's slice of the ``p_max`` model)."""
        shapes = {k: tuple(v.shape) for k, v in self._shapes_model.state_dict().items()}
        allowed = fjord.allowed_widths(self.p_values, self.rates[level_index])
        sizes = [{k: list(width.sub_shape(self.width_plan(p)[k], shapes[k])) for k in keys} for p in allowed]
        return {"p_values": allowed, "sizes": sizes, "distill": self.distill}

    def level_payload(self, level_index: int, global_state: State) -> tuple[dict[str, Any], State, dict[str, Any]]:
        spec, state, options = super().level_payload(level_index, global_state)
        return spec, state, {**options, "hook": "fjord", "hook_options": self.hook_options(level_index, list(state))}
