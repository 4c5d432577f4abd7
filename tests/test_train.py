"""Local training details: which parameters get ordinary weight decay."""

from __future__ import annotations

import torch

from fedhm_flwr.lowrank import FactorizedLinear
from fedhm_flwr.train import parameter_groups


def test_frobenius_decay_spares_the_factor_weights_but_not_the_biases():
    model = torch.nn.Sequential(FactorizedLinear.from_linear(torch.nn.Linear(8, 6), rank=2), torch.nn.Linear(6, 3))
    groups = parameter_groups(model, weight_decay=0.01, frobenius_decay=True)
    decay = {id(p) for g in groups if g["weight_decay"] == 0.01 for p in g["params"]}
    none = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    low = model[0]
    assert none == {id(low.a.weight), id(low.b.weight)}  # the pair: Frobenius decay instead
    assert id(low.a.bias) in decay  # the factorized layer's bias is a full-rank parameter
    assert decay | none == {id(p) for p in model.parameters()} and not decay & none
    plain = parameter_groups(model, weight_decay=0.01, frobenius_decay=False)
    assert len(plain) == 1 and len(plain[0]["params"]) == len(list(model.parameters()))
