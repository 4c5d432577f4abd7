"""Server strategies on Flower's Message API: one shared round (:class:`HeteroStrategy`) and one
Flower-free method per algorithm (:class:`fedhm_flwr.server.methods.method.Method`: ``FedHM``, ``HeteroFL``, ...).

A method is registered once, by naming its class in :data:`REGISTERED`; everything else follows
from that entry and from what the class declares (``name``, ``options``): :data:`METHODS`
(``method.name`` -> the method), :data:`STRATEGIES` (``method.name`` -> the round bound to it),
the ``<Method>Strategy`` names of this module (``FedHMStrategy(opts, model_spec, evaluate_fn, outputs)``
runs FedHM), the ``strategies`` face and the checks that the config's table of options
(:data:`fedhm_flwr.config.options.OPTIONS`, the list ``fedhm --help`` shows) names the same methods
(``tests/test_registry.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.server.methods.fedavg import FedAvg
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.fedlora import FedLoRA
from fedhm_flwr.server.methods.fedrolex import FedRolex
from fedhm_flwr.server.methods.fiarse import FIARSE
from fedhm_flwr.server.methods.fjord import FjORD
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.heterotune import HeteroTune
from fedhm_flwr.server.methods.method import Method
from fedhm_flwr.server.methods.prism import PriSM
from fedhm_flwr.server.strategy import HeteroStrategy

#: every method, each once (a class, or FedAvg's builder picking its family's class); the order of
#: :data:`METHODS`
REGISTERED: tuple[type[Method] | type[FedAvg], ...] = (
    FedHM,
    HeteroFL,
    FedRolex,
    FedAvg,
    FedLoRA,
    HeteroTune,
    PriSM,  # also OrthDrop and the ablations: method.sampling
    FjORD,
    FIARSE,
)

#: ``method.name`` -> the method (the ``name`` each declares)
METHODS: dict[str, Callable[[RunOptions, dict[str, Any]], Method]] = {m.name: m for m in REGISTERED}


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

#: the ``<Method>Strategy`` names this module answers (``from fedhm_flwr.server.registry import FedHMStrategy``)
STRATEGY_NAMES: dict[str, type[HeteroStrategy]] = {s.__name__: s for s in STRATEGIES.values()}


def __getattr__(name: str) -> type[HeteroStrategy]:
    """A ``<Method>Strategy`` of :data:`STRATEGY_NAMES` (PEP 562)."""
    try:
        return STRATEGY_NAMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


__all__ = ["METHODS", "REGISTERED", "STRATEGIES", "STRATEGY_NAMES", "HeteroStrategy", "Method", *STRATEGY_NAMES]
