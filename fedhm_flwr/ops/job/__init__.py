"""One job, from start to verdict: the launcher (``launch``), its processes and signals (``procs``,
``signals``), the run lock, the SuperLink and the ``flwr run`` job (``superlink``, ``flower_job``), how a run
ends (``outcome``, ``health``), the progress line and ``fedhm status``."""
