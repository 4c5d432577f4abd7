"""The old path of :mod:`fedhm_flwr.data.text`, kept for existing imports:
``import fedhm_flwr.text_data`` gives that very module."""

import sys

from fedhm_flwr.data import text as _module

sys.modules[__name__] = _module
