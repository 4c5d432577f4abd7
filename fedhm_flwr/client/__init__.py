"""The client: ``handlers`` receives a message (one ClientApp, ``ops.apps.client_app``, serves every method),
builds the model it describes, trains or evaluates on the node's data and replies."""
