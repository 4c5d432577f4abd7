"""Entry points and processes, one folder per topic: ``apps`` (the Flower apps: ServerApp, ClientApp,
the ServerApp's watch on its SuperLink, an in-process grid), ``job`` (one job from start to verdict:
the launcher, its processes, the SuperLink, the ``flwr run`` job, exit codes, resume, progress,
``fedhm status``), ``sweeps`` (Hydra multiruns, ``fedhm sweep|compare``), ``deploy`` (``fedhm
supernode``, credentials, ``fedhm deploy-local``, ``fedhm stage``, the nodes' data shards) and
``tools`` (cost tables, model export, pre-training); ``cli`` is the ``fedhm`` command."""
