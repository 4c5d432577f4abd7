"""Many jobs: Hydra multirun sweeps (``sweep``), ``fedhm sweep|compare`` (``multirun``) and the sweep's
opt-in shared Ray instance (``shared_ray``, ``ray_supervisor``)."""
