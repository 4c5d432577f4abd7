#!/usr/bin/env python3
"""``fedhm deploy-local`` (:mod:`fedhm_flwr.ops.deploy.deploy_local`), run from a checkout: the package of this
checkout, also where another checkout is the one installed in the environment.

``python scripts/deploy_local.py --nodes N ...`` = ``fedhm deploy-local --nodes N ...``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedhm_flwr.ops.deploy.deploy_local import main

if __name__ == "__main__":
    sys.exit(main())
