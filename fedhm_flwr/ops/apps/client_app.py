"""ClientApp: the train / evaluate / query handlers, the same for every method."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedhm_flwr.client import handlers as base

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model the message describes on this node's data."""
    return base.handle_train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model the message describes on this node's data."""
    return base.handle_evaluate(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Answer the server's questions about this node (partition, capability, ...)."""
    return base.handle_query(msg, context)
