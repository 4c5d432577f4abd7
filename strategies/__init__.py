"""Server strategies on Flower's Message API: a shared heterogeneous round and one class per method."""

from __future__ import annotations

from .base import HeteroStrategy
from .fedhm import FedHMStrategy

#: ``method.name`` -> strategy class
STRATEGIES: dict[str, type[HeteroStrategy]] = {
    FedHMStrategy.name: FedHMStrategy,
}

__all__ = ["STRATEGIES", "HeteroStrategy", "FedHMStrategy"]
