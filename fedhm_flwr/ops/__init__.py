"""Entry points and processes: the Flower apps (``server_app``, ``client_app``), the ``fedhm`` command
(``cli``), the launcher (SuperLink start, ``flwr run`` job, run lock, exit codes, resume), sweeps,
``fedhm deploy-local``, SuperNodes, cost tables, model and shard export."""
