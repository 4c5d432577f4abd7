"""``python -m fedhm_flwr``: the ``fedhm`` command."""

import sys

from fedhm_flwr.ops.cli import main

sys.exit(main())
