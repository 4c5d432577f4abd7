"""The design card's name for the client: a thin public face over ``fedhm_flwr.client``.

One ClientApp serves every method (the message says what to do). The code lives in one package
(``fedhm_flwr``, see docs/ARCHITECTURE.md); this face keeps ``from clients import app`` working.
"""

from fedhm_flwr.client.handlers import handle_evaluate, handle_query, handle_train
from fedhm_flwr.ops.apps.client_app import app

__all__ = ["app", "handle_evaluate", "handle_query", "handle_train"]
