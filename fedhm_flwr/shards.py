"""The old path of :mod:`fedhm_flwr.data.shards`, kept for existing imports and ``python -m fedhm_flwr.shards``:
``import fedhm_flwr.shards`` gives that very module."""

import sys

from fedhm_flwr.data import shards as _module

if __name__ == "__main__":  # python -m fedhm_flwr.shards
    raise SystemExit(_module.main())

sys.modules[__name__] = _module
