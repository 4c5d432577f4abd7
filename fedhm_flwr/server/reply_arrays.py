"""A reply's Arrays checked against the Arrays the node was sent, nothing decoded first
(:func:`sent_layout`), and read in one copy (:func:`reply_tensors`); a bn-stats reply checked against
the sums asked for (:func:`check_bn_reply`). The server's side of the wire: a node's reply is
untrusted input (docs/ROBUSTNESS.md); how tensors go on the wire both ways is
:mod:`fedhm_flwr.core.wire_arrays`.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedhm_flwr.core.bn_wire import bn_record
from fedhm_flwr.core.wire_arrays import NUMPY_DTYPES, array_layout, data_offset, from_wire, record_tensors

#: the most bytes a reply's ``.npy`` header may take (numpy writes 128 for any tensor of a model here;
#: its format 1.0 allows 65,535): a reply holding more than its data and this is refused unread
MAX_HEADER_BYTES = 4096

#: numpy's readers of the ``.npy`` header versions np.save writes (another version is refused)
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}

#: what :func:`sent_layout` finds of a reply's Array: (numpy dtype, shape, element count, data offset)
Layout = tuple[np.dtype, tuple[int, ...], int, int]


def sent_layout(array: Any, sent: Any) -> Layout | str:
    """A reply's Array checked against the Array the node was sent for the same key, nothing decoded:
    its layout (numpy dtype, shape, element count, offset of the data in ``array.data``), or why it
    is refused.

    The reply must declare the dtype, stype and shape it was sent, and its bytes must be exactly a
    ``.npy`` header declaring that same dtype and shape in C order, followed by the data of that many
    elements: ``count · itemsize`` bytes plus a header of at most :data:`MAX_HEADER_BYTES`. The byte
    length is checked before the header is read, so a reply larger than what was sent is refused
    without decoding any of it; the header is read with numpy's own reader (no pickle, bounded)."""
    if not isinstance(array, Array) or not isinstance(array.data, bytes):
        return "is not an array"
    if array.stype != sent.stype or array.dtype != sent.dtype:
        return f"is {array.stype} {array.dtype!r}, was sent {sent.stype} {sent.dtype!r}"
    shape = tuple(sent.shape)
    if not isinstance(array.shape, (list, tuple)) or tuple(array.shape) != shape:
        return f"declares shape {array.shape!r}, was sent {shape}"
    layout = array_layout(sent.dtype, shape)
    if layout is None:  # (the server never sends such an array)
        return f"has dtype {sent.dtype!r}, which the wire does not carry"
    dtype, count, known, _ = layout
    data = array.data
    header = len(data) - dtype.itemsize * count
    if not 10 <= header <= MAX_HEADER_BYTES:
        return (
            f"holds {len(data)} bytes; {sent.dtype} of shape {shape} takes {dtype.itemsize * count} "
            f"plus a header of at most {MAX_HEADER_BYTES}"
        )
    if known is not None and header == len(known) and data.startswith(known):
        return dtype, shape, count, header
    stream = io.BytesIO(data[:header])
    try:
        read = _HEADER_READERS[np.lib.format.read_magic(stream)]
        declared, fortran, declared_dtype = read(stream, max_header_size=MAX_HEADER_BYTES)
    except Exception as exc:  # noqa: BLE001 (any malformed header is a refusal, never a crash)
        return f"bytes do not start with a .npy header ({type(exc).__name__})"
    if tuple(declared) != shape or fortran or declared_dtype != dtype or stream.tell() != header:
        return (
            f"bytes declare {declared_dtype} of shape {tuple(declared)}{' (Fortran order)' if fortran else ''}, "
            f"not the {sent.dtype} of shape {shape} it declares"
        )
    return dtype, shape, count, header


#: the numpy dtype a floating tensor travels in, per wire dtype (bfloat16: its raw bits as int16)
_WIRE_NUMPY = {"float32": "float32", "float16": "float16", "bfloat16": "int16"}


def reply_tensors(
    record: Any, dtype: str = "float32", layouts: Mapping[str, Layout] | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``from_wire(record_tensors(record), dtype)``, and every floating value of it in one flat
    float32 tensor (None when some floating tensor is not in it).

    The arrays in the wire dtype's numpy dtype are copied, in record order, into one buffer,
    converted to float32 at once (float16, bfloat16) and handed out as views of it: the values are
    those :func:`record_tensors` and :func:`from_wire` give one by one, and the flat tensor lets a
    screen see a whole reply in one op (:func:`fedhm_flwr.math.robust.oversized`). Any other array
    (another dtype, another layout) is read as :func:`record_tensors` reads it. ``layouts``: where
    :func:`sent_layout` found each array's data (a reply checked against what was sent), used as found."""
    wire = _WIRE_NUMPY[dtype]
    located: list[tuple[str, tuple[int, ...], int]] = []
    chunks, others, total = [], {}, 0
    for key, array in record.items():
        found = (layouts[key] if layouts is not None else data_offset(array)) if array.dtype == wire else None
        if found is None:
            others[key] = array
            continue
        _, shape, count, offset = found
        located.append((key, shape, count))
        chunks.append(memoryview(array.data)[offset:])  # (the data runs to the end of the bytes)
        total += count
    # one copy of every located array, in record order, into one buffer
    buffer = np.empty(total, dtype=NUMPY_DTYPES[wire])
    raw, at = buffer.data.cast("B"), 0
    for chunk in chunks:
        raw[at : at + len(chunk)] = chunk
        at += len(chunk)
    flat = torch.from_numpy(buffer)
    if dtype != "float32":  # (one conversion for the whole reply)
        flat = (flat.view(torch.bfloat16) if dtype == "bfloat16" else flat).float()
        buffer = flat.numpy()
    views, start = {}, 0
    for key, shape, count in located:  # (numpy views: cheaper than torch's per tensor)
        views[key] = torch.from_numpy(buffer[start : start + count].reshape(shape))
        start += count
    rest = from_wire(record_tensors(others), dtype) if others else {}
    out = {key: views[key] if key in views else rest[key] for key in record}
    return out, None if any(t.is_floating_point() for t in rest.values()) else flat


@dataclass(frozen=True)
class _SUMS:
    """What every array of a bn-stats reply must be (as if sent so): float32 of its sum's shape."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    stype: str = "numpy.ndarray"


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
