"""What the bench's figures share: a median timer and the instant clients of the server figures."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median and spread (min, max) of ``fn``'s wall time in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return spread(times)


def spread(values: list[float]) -> dict[str, float]:
    """``{median_s, min_s, max_s, repeats}`` of measured values (seconds, or ratios of them)."""
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "repeats": len(values)}


def identity_query(msg: Any, context: Any) -> Any:
    """The node-info answer of a node that holds no data (the server figures never train on any,
    and ResNet's CIFAR-10 need not be on this machine): its identity, without the example count the
    run's data spec would ask for (:func:`fedhm_flwr.client.handlers.node_info`)."""
    from flwr.app import Message, RecordDict

    from fedhm_flwr.client.handlers import node_info
    from fedhm_flwr.core.protocol import CONFIG

    return Message(RecordDict({CONFIG: node_info(context)}), reply_to=msg)


def echo(msg: Any, context: Any) -> Any:
    """A client that trains instantly: it sends back the arrays it received, 100 examples, every class,
    with the metrics an honest client's reply carries (so the server accepts it and aggregates)."""
    from flwr.app import Message, RecordDict

    from fedhm_flwr.core.protocol import ARRAYS, CONFIG, LEVEL, METRICS, train_metrics

    level = float(msg.content[CONFIG][LEVEL])
    metrics = train_metrics(100, 0.0, 0.1, 0.0, level, [10] * 10)
    return Message(RecordDict({ARRAYS: msg.content[ARRAYS], METRICS: metrics}), reply_to=msg)
