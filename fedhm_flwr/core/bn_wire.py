"""The bn-stats query's records (docs/METHODS.md, sBN): any number of models in one message, model
``i``'s arrays in the record :func:`bn_record` (i) and its sums in the reply's record of the same
name; :func:`check_bn_reply` refuses a reply that is not exactly the sums asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, RecordDict

from fedhm_flwr.core.protocol import ARRAYS
from fedhm_flwr.core.wire_arrays import record_tensors, sent_layout


@dataclass(frozen=True)
class _SUMS:
    """What every array of a bn-stats reply must be (as if sent so): float32 of its sum's shape."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    stype: str = "numpy.ndarray"


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


def check_bn_reply(
    content: RecordDict,
    expected: Sequence[Mapping[str, tuple[int, ...]]],
) -> tuple[list[dict[str, torch.Tensor]] | None, str]:
    """A bn-stats reply checked against the models asked for (``expected[i]``: model i's
    :func:`bn_sum_shapes`): (each model's sums, "") or (None, why it is refused). The reply must
    hold one record per model asked and nothing else; a record holds whole layers (sum, sumsq and
    count) of that model, in their shapes, as float32 arrays of exactly their size (checked before any
    tensor is read), finite, counts and sums of squares non-negative. A record may be empty (a node
    without training examples sums nothing)."""
    names = [bn_record(i) for i in range(len(expected))]
    if set(content) != set(names):
        missing, extra = sorted(set(names) - set(content)), sorted(set(content) - set(names))
        return None, (
            f"reply records do not match the {len(names)} models asked: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, shapes in zip(names, expected):
        record = content[name]
        if not isinstance(record, ArrayRecord):
            return None, f"'{name}' is not an ArrayRecord"
        extra = sorted(set(record) - set(shapes))
        if extra:
            return None, f"'{name}' holds keys of no norm layer of that model: {extra[:3]}"
        layers = {key.rsplit(".", 1)[0] for key in record}
        partial = sorted(
            f"{layer}.{part}"
            for layer in layers
            for part in ("sum", "sumsq", "count")
            if f"{layer}.{part}" not in record
        )
        if partial:
            return None, f"'{name}' lacks {partial[:3]}"
        for key, array in record.items():  # dtype, shape and byte length before any tensor is read
            found = sent_layout(array, _SUMS(shape=shapes[key]))
            if isinstance(found, str):
                return None, f"'{name}': {key} {found}"
    out = []
    for name in names:
        tensors = record_tensors(content[name])
        bad = sorted(
            k
            for k, t in tensors.items()
            if not bool(torch.isfinite(t).all()) or (not k.endswith(".sum") and bool((t < 0).any()))
        )
        if bad:
            return None, f"'{name}': {bad[:3]} hold NaN/Inf, or a negative count or sum of squares"
        out.append(tensors)
    return out, ""
