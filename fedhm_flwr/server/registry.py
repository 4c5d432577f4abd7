"""Server strategies on Flower's Message API: one shared round (:class:`HeteroStrategy`) and one
Flower-free method per algorithm (:class:`fedhm_flwr.server.methods.method.Method`: ``FedHM``, ``HeteroFL``, ...).

``<Method>Strategy`` binds a method to the round (``FedHMStrategy(opts, model_spec, evaluate_fn,
outputs)`` runs FedHM); :data:`STRATEGIES` maps ``method.name`` to those bindings, :data:`METHODS`
to the methods themselves. A method is registered by its one entry in :data:`METHODS`; its binding
follows from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.server.methods.fedavg import FedAvg
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.fedlora import FedLoRA
from fedhm_flwr.server.methods.fedrolex import FedRolex
from fedhm_flwr.server.methods.fjord import FjORD
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.heterotune import HeteroTune
from fedhm_flwr.server.methods.method import Method
from fedhm_flwr.server.methods.prism import PriSM
from fedhm_flwr.server.strategy import HeteroStrategy

#: ``method.name`` -> the method (a class, or FedAvg's builder picking its family's class)
METHODS: dict[str, Callable[[RunOptions, dict[str, Any]], Method]] = {
    "fedhm": FedHM,
    "heterofl": HeteroFL,
    "fedrolex": FedRolex,
    "fedavg": FedAvg,
    "fedlora": FedLoRA,
    "heterotune": HeteroTune,
    "prism": PriSM,  # also OrthDrop and the ablations: method.sampling
    "fjord": FjORD,
}


def _binding(name: str, method: Callable[[RunOptions, dict[str, Any]], Method]) -> type[HeteroStrategy]:
    """The round bound to one method: ``<Name>Strategy(opts, model_spec, evaluate_fn, outputs)``
    (``opts``: the run's :class:`~fedhm_flwr.config.options.RunOptions`)."""
    return type(
        name,
        (HeteroStrategy,),
        {
            "method_class": staticmethod(method),
            "__module__": __name__,
            "__doc__": f"The shared round running {method.__name__}.",
        },
    )


#: ``method.name`` -> strategy class (the round bound to the method: ``<Method>Strategy``)
STRATEGIES: dict[str, type[HeteroStrategy]] = {
    name: _binding(f"{method.__name__}Strategy", method) for name, method in METHODS.items()
}

FedHMStrategy = STRATEGIES["fedhm"]
HeteroFLStrategy = STRATEGIES["heterofl"]
FedRolexStrategy = STRATEGIES["fedrolex"]
FedAvgStrategy = STRATEGIES["fedavg"]
FedLoRAStrategy = STRATEGIES["fedlora"]
HeteroTuneStrategy = STRATEGIES["heterotune"]
PriSMStrategy = STRATEGIES["prism"]

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
