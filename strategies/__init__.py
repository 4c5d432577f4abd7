"""Server strategies on Flower's Message API: a shared heterogeneous round and one class per method."""

from __future__ import annotations

from .base import HeteroStrategy
from .fedavg import FedAvgStrategy
from .fedhm import FedHMStrategy
from .fedlora import FedLoRAStrategy
from .fedrolex import FedRolexStrategy
from .heterofl import HeteroFLStrategy
from .heterotune import HeteroTuneStrategy
from .prism import PriSMStrategy

#: ``method.name`` -> strategy class
STRATEGIES: dict[str, type[HeteroStrategy]] = {
    FedHMStrategy.name: FedHMStrategy,
    HeteroFLStrategy.name: HeteroFLStrategy,
    FedRolexStrategy.name: FedRolexStrategy,
    FedAvgStrategy.name: FedAvgStrategy,
    FedLoRAStrategy.name: FedLoRAStrategy,
    HeteroTuneStrategy.name: HeteroTuneStrategy,
    PriSMStrategy.name: PriSMStrategy,  # also OrthDrop and the ablations: method.sampling
}

__all__ = ["STRATEGIES", "HeteroStrategy", "FedHMStrategy"]
