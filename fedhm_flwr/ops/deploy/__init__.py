"""Real deployments: ``fedhm supernode`` (``supernode``, ``link_watch``), credentials, a TLS deployment on
loopback (``loopback``, ``fedhm deploy-local``: ``deploy_local``), ``fedhm stage`` and the nodes' data
shards (``shard_export``)."""
