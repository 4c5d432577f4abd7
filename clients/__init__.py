"""The design card's name for the client: a thin public face over ``fedhm_flwr.client``.

One ClientApp serves every method (the message says what to do), every one the config accepts
(:data:`METHODS`, derived from the table of method options). The code lives in one package
(``fedhm_flwr``, see docs/ARCHITECTURE.md); this face keeps ``from clients import app`` working.
"""

from fedhm_flwr.client.handlers import handle_evaluate, handle_query, handle_train
from fedhm_flwr.config.options import OPTIONS
from fedhm_flwr.ops.apps.client_app import app

#: the ``method.name`` of every method this ClientApp serves (every registered one)
METHODS: tuple[str, ...] = tuple(OPTIONS)

__all__ = ["METHODS", "app", "handle_evaluate", "handle_query", "handle_train"]
