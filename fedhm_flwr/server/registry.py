"""Server strategies on Flower's Message API: one shared round (:class:`HeteroStrategy`) and one
Flower-free method per algorithm (:class:`fedhm_flwr.server.methods.method.Method`: ``FedHM``, ``HeteroFL``, ...).

``<Method>Strategy`` binds a method to the round (``FedHMStrategy(cfg, model_spec, evaluate_fn,
recorder)`` runs FedHM); :data:`STRATEGIES` maps ``method.name`` to those bindings, :data:`METHODS`
to the methods themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from fedhm_flwr.server.methods.fedavg import FedAvg
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.fedlora import FedLoRA
from fedhm_flwr.server.methods.fedrolex import FedRolex
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.heterotune import HeteroTune
from fedhm_flwr.server.methods.method import Method
from fedhm_flwr.server.methods.prism import PriSM
from fedhm_flwr.server.strategy import HeteroStrategy

#: ``method.name`` -> the method (a class, or FedAvg's builder picking its family's class)
METHODS: dict[str, Callable[[DictConfig, dict[str, Any]], Method]] = {
    "fedhm": FedHM,
    "heterofl": HeteroFL,
    "fedrolex": FedRolex,
    "fedavg": FedAvg,
    "fedlora": FedLoRA,
    "heterotune": HeteroTune,
    "prism": PriSM,  # also OrthDrop and the ablations: method.sampling
}


def _binding(name: str, method: Callable[[DictConfig, dict[str, Any]], Method]) -> type[HeteroStrategy]:
    """The round bound to one method: ``<Name>Strategy(cfg, model_spec, evaluate_fn, recorder)``."""
    return type(name, (HeteroStrategy,), {"method_class": staticmethod(method), "__module__": __name__,
                                          "__doc__": f"The shared round running {method.__name__}."})


FedHMStrategy = _binding("FedHMStrategy", FedHM)
HeteroFLStrategy = _binding("HeteroFLStrategy", HeteroFL)
FedRolexStrategy = _binding("FedRolexStrategy", FedRolex)
FedAvgStrategy = _binding("FedAvgStrategy", FedAvg)
FedLoRAStrategy = _binding("FedLoRAStrategy", FedLoRA)
HeteroTuneStrategy = _binding("HeteroTuneStrategy", HeteroTune)
PriSMStrategy = _binding("PriSMStrategy", PriSM)

#: ``method.name`` -> strategy class (the round bound to the method)
STRATEGIES: dict[str, type[HeteroStrategy]] = {
    "fedhm": FedHMStrategy,
    "heterofl": HeteroFLStrategy,
    "fedrolex": FedRolexStrategy,
    "fedavg": FedAvgStrategy,
    "fedlora": FedLoRAStrategy,
    "heterotune": HeteroTuneStrategy,
    "prism": PriSMStrategy,
}

__all__ = [
    "METHODS",
    "STRATEGIES",
    "FedAvgStrategy",
    "FedHM",
    "FedHMStrategy",
    "FedLoRAStrategy",
    "FedRolexStrategy",
    "HeteroFLStrategy",
    "HeteroStrategy",
    "HeteroTuneStrategy",
    "Method",
    "PriSMStrategy",
]
