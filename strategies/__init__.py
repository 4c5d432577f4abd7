"""The design card's name for the server strategies: a thin public face over ``fedhm_flwr.server``.

The code lives in one package (``fedhm_flwr``, grouped by layer, see docs/ARCHITECTURE.md); this
face keeps ``from strategies import FedHMStrategy, STRATEGIES`` working for users' scripts. The
project's own modules import ``fedhm_flwr.server`` directly.
"""

from fedhm_flwr.server.methods.fedavg import FedAvg
from fedhm_flwr.server.methods.fedhm import FedHM
from fedhm_flwr.server.methods.fedlora import FedLoRA
from fedhm_flwr.server.methods.fedrolex import FedRolex
from fedhm_flwr.server.methods.heterofl import HeteroFL
from fedhm_flwr.server.methods.heterotune import HeteroTune
from fedhm_flwr.server.methods.method import Method
from fedhm_flwr.server.methods.prism import PriSM
from fedhm_flwr.server.registry import (
    METHODS,
    STRATEGIES,
    FedAvgStrategy,
    FedHMStrategy,
    FedLoRAStrategy,
    FedRolexStrategy,
    HeteroFLStrategy,
    HeteroTuneStrategy,
    PriSMStrategy,
)
from fedhm_flwr.server.strategy import HeteroStrategy

__all__ = [
    "METHODS",
    "STRATEGIES",
    "FedAvg",
    "FedAvgStrategy",
    "FedHM",
    "FedHMStrategy",
    "FedLoRA",
    "FedLoRAStrategy",
    "FedRolex",
    "FedRolexStrategy",
    "HeteroFL",
    "HeteroFLStrategy",
    "HeteroStrategy",
    "HeteroTune",
    "HeteroTuneStrategy",
    "Method",
    "PriSM",
    "PriSMStrategy",
]
