"""``fedhm stage DEST``: the app alone, staged for ``flwr run`` on real devices (docs/DEPLOY.md).

``flwr run <folder>`` sends the bundle Flower builds of the whole folder to the SuperLink and every
device: from a checkout, also ``tests/``, ``docs/``, ``results/`` and any outputs there. This copies
only the app's own files (:func:`fedhm_flwr.ops.job.superlink.stage_app`, as ``fedhm deploy-local``
stages it) to DEST, prints DEST alone on stdout (``flwr run "$(fedhm stage DEST)" ...``) and, on
stderr, the size of the bundle Flower builds of it. A DEST it would empty or copy into itself is
refused first (exit 2), untouched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

from fedhm_flwr.ops.job.superlink import APP_CONTENT, APP_DIR, stage_app


def check_dest(dest: Path) -> Path:
    """Where :func:`stage_app` may write, resolved; ValueError naming DEST otherwise.

    :func:`stage_app` empties its destination first, so DEST must be new, empty or an earlier stage
    (nothing but :data:`APP_CONTENT` in it), never a file, the checkout or a folder above it, or a
    folder inside the app's own files (copied into itself). The app is staged from a checkout
    (``pip install -e .``): a plain install has no ``pyproject.toml`` to stage."""
    if not (APP_DIR / "pyproject.toml").is_file():
        raise ValueError(
            f"no pyproject.toml in {APP_DIR}: the app is staged from a checkout of the repository "
            "(installed with `pip install -e .`)"
        )
    target = dest.expanduser().resolve()
    if target == APP_DIR or target in APP_DIR.parents:
        raise ValueError(f"DEST {dest} is the checkout or a folder above it: choose a folder of its own")
    inside = [name for name in APP_CONTENT if target == APP_DIR / name or (APP_DIR / name) in target.parents]
    if inside:
        raise ValueError(
            f"DEST {dest} lies in the app's own files ({APP_DIR / inside[0]}): choose a folder outside them"
        )
    if target.exists() and not target.is_dir():
        raise ValueError(f"DEST {dest} is a file: give a folder (new, empty, or an earlier `fedhm stage` folder)")
    if target.is_dir():
        other = sorted(p.name for p in target.iterdir() if p.name not in APP_CONTENT)
        if other:
            shown = ", ".join(other[:5]) + (" ..." if len(other) > 5 else "")
            raise ValueError(
                f"DEST {dest} holds other files ({shown}); "
                "give a new or empty folder, or an earlier `fedhm stage` folder (it is replaced)"
            )
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedhm stage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "dest", type=Path, help="the folder to stage the app in: new, empty, or an earlier stage (replaced)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        dest = check_dest(args.dest)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    app = stage_app(dest)
    size = len(build_fab_from_disk(app))  # what `flwr run <app>` builds and sends (Flower's own builder)
    print(
        f"staged the app in {app}: `flwr run` sends it as a {size / 1e6:.2f} MB bundle ({size} bytes)", file=sys.stderr
    )
    print(app)  # alone on stdout: flwr run "$(fedhm stage DEST)" ...
    return 0


if __name__ == "__main__":
    sys.exit(main())
