"""The old path of :mod:`fedhm_flwr.data.files`, kept for existing imports:
``import fedhm_flwr.data_files`` gives that very module."""

import sys

from fedhm_flwr.data import files as _module

sys.modules[__name__] = _module
