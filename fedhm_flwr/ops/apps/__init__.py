"""The Flower apps: the ServerApp (``server_app``) and the ClientApp (``client_app``), the ServerApp's
watch on its SuperLink (``superlink_watch``), and an in-process grid for tests (``local_grid``)."""
