"""The process that holds a sweep's shared Ray instance (:mod:`fedhm_flwr.ops.sweeps.shared_ray` starts it):
``ray.init`` of a local instance, its address printed on one line, then it waits for SIGTERM or the end
of its stdin and stops the instance (``ray.shutdown``: the Ray processes it started, and only those)."""

from __future__ import annotations

import signal
import sys
import threading
import warnings

import ray

from fedhm_flwr.ops.sweeps.shared_ray import READY


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the supervisor process
    """The supervisor: ``ray.init`` a local instance, print its address, wait for SIGTERM or stdin's end."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # Ray's notice about accelerator variables
    num_cpus = int((argv if argv is not None else sys.argv[1:])[0])
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())  # the sweep's Ctrl-C: ended by the sweep, after its job
    ray.init(  # (ray types logging_level as an int; it takes a level's name too)
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level="ERROR",  # type: ignore[arg-type]
        log_to_driver=False,
    )
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after ray.init, which sets its own
    print(f"{READY}{ray.get_runtime_context().gcs_address}", flush=True)

    def stdin_ended() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stdin_ended, daemon=True).start()
    while not stop.wait(0.5):
        pass
    ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
