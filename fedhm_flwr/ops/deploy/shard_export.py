"""``python -m fedhm_flwr.ops.deploy.shard_export <the run's Hydra overrides> out=DIR`` (also ``fedhm shards``): write
every partition of a run as a node's own data shard (the format and the loader are in
:mod:`fedhm_flwr.data.shards`; this entry point composes the run's config, so it sits above it)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fedhm_flwr.config import load_config, run_options
from fedhm_flwr.core.errors import ConfigError, ShardError
from fedhm_flwr.data import shards


def _parse_args(argv: Sequence[str]) -> tuple[list[str], str | None]:
    overrides, out = [], None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(shards.__doc__)
            raise SystemExit(0)
        if arg == "--out":
            if not args:
                raise ShardError("--out needs a folder")
            out = args.pop(0)
        elif arg.startswith("--out=") or arg.startswith("out="):
            out = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return overrides, out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedhm_flwr.ops.deploy.shard_export <overrides> out=DIR``: exit 0, or 2 with one line on stderr."""
    try:
        overrides, out = _parse_args(sys.argv[1:] if argv is None else argv)
        if not out:
            raise ConfigError("out", None, "a folder to write the shards into (out=DIR or --out DIR)")
        opts = run_options(load_config(overrides))
        shards.export_shards(opts.data_spec(), out, opts.dataset.data_dir)
    except (ConfigError, ShardError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
