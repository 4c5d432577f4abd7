"""The bn-stats query's records (docs/METHODS.md, sBN): any number of models in one message, model
``i``'s arrays in the record :func:`bn_record` (i) and its sums in the reply's record of the same
name; :func:`check_bn_reply` refuses a reply that is not exactly the sums asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from flwr.app import ArrayRecord, RecordDict

from fedhm_flwr.core.protocol import ARRAYS
from fedhm_flwr.core.wire_arrays import record_tensors


def bn_record(index: int) -> str:
    """The record holding model ``index``'s arrays in a bn-stats query, and its sums in the reply."""
    return f"{ARRAYS}.{index}"


def bn_sum_shapes(layers: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """The arrays a node's sums of one model may hold, by key, with their shapes: per norm layer
    (``layers``: name -> channels) ``<layer>.sum`` and ``<layer>.sumsq`` per channel, ``<layer>.count``
    a scalar (:func:`fedhm_flwr.math.bn_stats.bn_sums`)."""
    return {f"{name}.{part}": shape for name, channels in layers.items()
            for part, shape in (("sum", (channels,)), ("sumsq", (channels,)), ("count", ()))}


def check_bn_reply(content: RecordDict, expected: Sequence[Mapping[str, tuple[int, ...]]],
                   ) -> tuple[list[dict[str, torch.Tensor]] | None, str]:
    """A bn-stats reply checked against the models asked for (``expected[i]``: model i's
    :func:`bn_sum_shapes`): (each model's sums, "") or (None, why it is refused). The reply must
    hold one record per model asked and nothing else; a record holds whole layers (sum, sumsq and
    count) of that model, in their shapes, as floating arrays; shapes are checked before any
    tensor is read. A record may be empty (a node without training examples sums nothing)."""
    names = [bn_record(i) for i in range(len(expected))]
    if set(content) != set(names):
        missing, extra = sorted(set(names) - set(content)), sorted(set(content) - set(names))
        return None, (f"reply records do not match the {len(names)} models asked: "
                      f"missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shapes in zip(names, expected):
        record = content[name]
        if not isinstance(record, ArrayRecord):
            return None, f"'{name}' is not an ArrayRecord"
        extra = sorted(set(record) - set(shapes))
        if extra:
            return None, f"'{name}' holds keys of no norm layer of that model: {extra[:3]}"
        layers = {key.rsplit(".", 1)[0] for key in record}
        partial = sorted(f"{layer}.{part}" for layer in layers for part in ("sum", "sumsq", "count")
                         if f"{layer}.{part}" not in record)
        if partial:
            return None, f"'{name}' lacks {partial[:3]}"
        for key, array in record.items():
            if tuple(array.shape) != shapes[key] or array.dtype not in ("float16", "float32", "float64"):
                return None, (f"'{name}': {key} is {array.dtype} of shape {tuple(array.shape)}, "
                              f"needs float of shape {shapes[key]}")
    out = []
    for name, shapes in zip(names, expected):
        try:
            tensors = record_tensors(content[name])
        except (ValueError, TypeError, OSError, EOFError) as exc:  # bytes that are no array of the declared kind
            return None, f"'{name}' does not read as arrays: {exc}"
        for key, tensor in tensors.items():  # the bytes' own header may say otherwise than the record
            if tuple(tensor.shape) != shapes[key] or not tensor.is_floating_point():
                return None, f"'{name}': {key} reads as {tensor.dtype} of shape {tuple(tensor.shape)}"
        out.append(tensors)
    return out, ""
