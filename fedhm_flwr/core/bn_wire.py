"""The bn-stats query's records (docs/METHODS.md, sBN): any number of models in one message, model
``i``'s arrays in the record :func:`bn_record` (i) and its sums in the reply's record of the same
name; the server's check of a reply (:func:`fedhm_flwr.server.reply_arrays.check_bn_reply`) refuses
one that is not exactly the sums asked for."""

from __future__ import annotations

from collections.abc import Mapping

from fedhm_flwr.core.protocol import ARRAYS


def bn_record(index: int) -> str:
    """The record holding model ``index``'s arrays in a bn-stats query, and its sums in the reply."""
    return f"{ARRAYS}.{index}"


def bn_sum_shapes(layers: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """The arrays a node's sums of one model may hold, by key, with their shapes: per norm layer
    (``layers``: name -> channels) ``<layer>.sum`` and ``<layer>.sumsq`` per channel, ``<layer>.count``
    a scalar (:func:`fedhm_flwr.math.bn_stats.bn_sums`)."""
    return {
        f"{name}.{part}": shape
        for name, channels in layers.items()
        for part, shape in (("sum", (channels,)), ("sumsq", (channels,)), ("count", ()))
    }
