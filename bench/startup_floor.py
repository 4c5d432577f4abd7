"""What any Ray-backed job must do before its first round, written apart from the project (nothing here
imports ``fedhm_flwr``, ``strategies`` or ``clients``): the floor of figure 10 (:mod:`bench.startup`).

    python -m bench.startup_floor out.json [--folder /usr/share/datasets/fashion-mnist] [--workers 2]

In one process, as the job's simulation process does: import torch and flwr (the server's imports),
``ray.init`` on as many CPUs as workers (``PYTHONPATH`` in the runtime environment, as Flower's Ray
backend sets it), then that many actors of one CPU each, which import torch and decode the training
split (:func:`bench.whole_job_floor.fashion_mnist`: gzip + numpy, normalised into a tensor) and say
when they were done; then ``ray.shutdown``. Writes the wall-clock marks (``time.time()``) of each step to
``out.json``; the caller adds its own spawn and exit times (:func:`bench.startup.floor_parts`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


class Worker:
    """A Ray actor that imports torch and decodes the training split, as a simulated node's worker does."""

    def ready(self, folder: str) -> dict[str, float]:
        started = time.time()
        import torch  # noqa: F401  (the import is the work measured)

        imported = time.time()
        from bench.whole_job_floor import fashion_mnist

        x, _ = fashion_mnist(Path(folder), "train")
        return {"call_started_at": started, "imported_at": imported, "decoded_at": time.time(), "examples": len(x)}


def floor(folder: Path, workers: int) -> dict[str, Any]:
    """The steps' marks (see the module's docstring)."""
    marks: dict[str, Any] = {"main_started_at": time.time()}
    import flwr.app
    import flwr.clientapp
    import flwr.serverapp  # noqa: F401
    import torch  # noqa: F401

    marks["imported_at"] = time.time()
    import ray

    ray.init(
        num_cpus=workers,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    marks["ray_ready_at"] = time.time()
    actor = ray.remote(num_cpus=1)(Worker)
    pool = [actor.remote() for _ in range(workers)]  # type: ignore[attr-defined]
    marks["workers"] = ray.get([w.ready.remote(str(folder)) for w in pool])
    marks["workers_ready_at"] = time.time()
    ray.shutdown()
    marks["finished_at"] = time.time()
    return marks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--folder", type=Path, default=FASHION_MNIST)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    args.out.write_text(json.dumps(floor(args.folder, args.workers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
