"""The design card's name for the server strategies: a thin public face over ``fedhm_flwr.server``.

The code lives in one package (``fedhm_flwr``, grouped by layer, see docs/ARCHITECTURE.md); this
face keeps ``from strategies import FedHMStrategy, STRATEGIES`` working for users' scripts. Its names
are derived from the method registry (``fedhm_flwr.server.registry.REGISTERED``): every registered
method (``FedHM``, ...) and its strategy (``FedHMStrategy``, ...). The project's own modules import
``fedhm_flwr.server`` directly.
"""

from typing import Any

from fedhm_flwr.server.methods.method import Method
from fedhm_flwr.server.registry import METHODS, STRATEGIES, STRATEGY_NAMES
from fedhm_flwr.server.strategy import HeteroStrategy

#: every registered method and its strategy, by class name (``FedHM``, ``FedHMStrategy``, ...)
NAMES: dict[str, Any] = {**{m.__name__: m for m in METHODS.values()}, **STRATEGY_NAMES}

__all__ = ["METHODS", "NAMES", "STRATEGIES", "HeteroStrategy", "Method", *sorted(NAMES)]


def __getattr__(name: str) -> Any:
    """A registered method or its strategy, by class name (PEP 562)."""
    try:
        return NAMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
