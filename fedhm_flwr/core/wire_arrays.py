"""Model tensors on the wire: a tensor as a Flower ``Array`` in the wire dtype (``wire.dtype``) and
back, byte for byte what Flower itself would write and read. Part of the wire contract
(:mod:`fedhm_flwr.core.protocol` re-exports these names); torch is imported where tensors are converted,
since the config check imports the protocol without torch.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord

if TYPE_CHECKING:
    import torch

# arrays on the wire (wire.dtype): floating tensors travel in this dtype, the rest as they are.
# Flower's Array holds numpy data and numpy has no bfloat16: a bfloat16 tensor travels as its
# raw 16 bits in an int16 array, which the receiver (told the wire dtype) reinterprets.
WIRE_DTYPES = ("float32", "float16", "bfloat16")


def wire_array(tensor: torch.Tensor, dtype: str = "float32") -> Array:
    """One tensor as a flwr Array in the wire dtype (floating tensors cast, others unchanged).

    The bytes are what Flower's ``Array.from_torch_tensor`` writes (``np.save``: a ``.npy`` header,
    then the data in C order), put together here from the header of the tensor's dtype and shape
    (:func:`npy_header`, made once per dtype and shape) and the tensor's bytes: ``np.save`` costs a
    header formatted per call, several times the copy at the CNN's sizes."""
    import torch

    if tensor.requires_grad:  # (numpy() needs it; a detach per tensor otherwise is an op for nothing)
        tensor = tensor.detach()
    if tensor.is_floating_point():
        target = getattr(torch, dtype)
        if tensor.dtype != target:  # (each op skipped where it would hand the tensor back: a round makes dozens)
            tensor = tensor.to(target)
        if dtype == "bfloat16":
            tensor = tensor.view(torch.int16)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    ndarray = tensor.numpy()
    # (a tensor's numpy dtype is native: name == str; numpy's dtype.name is Python code, so the
    # common ones are looked up by the dtype itself)
    name, shape = _DTYPE_NAMES.get(ndarray.dtype) or ndarray.dtype.name, tuple(ndarray.shape)
    header = _NPY_HEADERS.get((name, shape)) or npy_header(name, shape)
    if header is None:
        return Array.from_numpy_ndarray(ndarray)
    return Array(dtype=name, shape=shape, stype="numpy.ndarray", data=b"".join((header, ndarray.data)))  # (one copy)


_NPY_HEADERS: dict[tuple[str, tuple[int, ...]], bytes | None] = {}
#: the numpy dtypes of the names the wire uses, parsed once (any other name is parsed per array)
_NUMPY_DTYPES = {
    name: np.dtype(name)
    for name in ("float32", "float16", "float64", "int16", "int32", "int64", "uint8", "int8", "bool")
}
_DTYPE_NAMES = {dtype: name for name, dtype in _NUMPY_DTYPES.items()}  # (and back)


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes | None:
    """The ``.npy`` header ``np.save`` writes before a C-ordered array of this dtype (numpy's name,
    as an Array holds it) and shape (format 1.0, numpy's own writer), or None for a dtype it would
    pickle or a header that needs a later format. Cached: one per dtype and shape (a model has a
    few dozen)."""
    key = (dtype, shape)
    if key not in _NPY_HEADERS:
        as_numpy = np.dtype(dtype)
        header = None
        if not as_numpy.hasobject:
            buffer = io.BytesIO()
            try:
                np.lib.format.write_array_header_1_0(
                    buffer, {"descr": np.lib.format.dtype_to_descr(as_numpy), "fortran_order": False, "shape": shape}
                )
                header = buffer.getvalue()
            except ValueError:  # a header too long for format 1.0: np.save's own choice decides
                header = None
        _NPY_HEADERS[key] = header
    return _NPY_HEADERS[key]


def array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """A fresh ArrayRecord holding these Arrays themselves (an Array is never changed once made, so
    records of one payload share its Arrays and their bytes; Flower's ``from_array_dict`` rebuilds
    every Array, with its argument checks, for every record)."""
    record = ArrayRecord()
    for key, array in arrays.items():
        record[key] = array
    return record


#: per Array dtype name and shape: (numpy dtype, element count, the header :func:`npy_header`
#: makes, the bytes of header and data), worked out once (a model has a few dozen)
_LAYOUTS: dict[tuple[str, tuple[int, ...]], tuple[np.dtype, int, bytes | None, int] | None] = {}


def _layout(name: str, shape: tuple[int, ...]) -> tuple[np.dtype, int, bytes | None, int] | None:
    key = (name, shape)
    if key not in _LAYOUTS:
        try:
            dtype = _NUMPY_DTYPES.get(name) or np.dtype(name)
        except TypeError:
            dtype = None
        if dtype is None or dtype.hasobject:
            _LAYOUTS[key] = None
        else:
            count = math.prod(shape)
            header = npy_header(name, shape)
            _LAYOUTS[key] = (dtype, count, header, (len(header) if header else 0) + dtype.itemsize * count)
    return _LAYOUTS[key]


def _data_offset(array: Any) -> tuple[np.dtype, tuple[int, ...], int, int] | None:
    """(numpy dtype, shape, element count, offset of the data in ``array.data``) of an Array whose
    bytes are a ``.npy`` header declaring its own dtype and shape in C order followed by the data;
    None for anything else (read through ``Array.numpy()``). The header :func:`npy_header` makes
    for the dtype and shape is recognised as it is; a header differing only in its padding or form
    (another numpy's ``np.save``) by what it declares, the data then read from the end of the bytes
    (where ``np.save`` puts it)."""
    if array.stype != "numpy.ndarray" or not isinstance(array.dtype, str):
        return None
    shape, data = tuple(array.shape), array.data
    layout = _layout(array.dtype, shape)
    if layout is None:
        return None
    dtype, count, known, size = layout
    if known is not None and len(data) == size and data.startswith(known):
        return dtype, shape, count, len(known)
    offset = len(data) - dtype.itemsize * count
    header = bytes(data[: min(max(offset, 0), 4096)])
    if not (
        offset > 0
        and header.startswith(b"\x93NUMPY")
        and b"'fortran_order': False" in header
        and f"'descr': '{dtype.str}'".encode() in header
        and f"'shape': {shape}".encode() in header
    ):
        return None
    return dtype, shape, count, offset


def record_tensors(record: Any) -> dict[str, torch.Tensor]:
    """An ArrayRecord's tensors, each copied once out of its Array's bytes.

    Flower's ``to_torch_state_dict`` parses every array's ``.npy`` header with ``np.load`` (a third
    of a round's aggregation at ResNet-18 size); here an array :func:`_data_offset` locates is read
    from after its header; anything else goes through ``Array.numpy()``."""
    import torch

    out = {}
    for key, array in record.items():
        located = _data_offset(array)
        if located is None:
            out[key] = torch.from_numpy(array.numpy())
            continue
        dtype, shape, count, offset = located
        flat = np.frombuffer(array.data, dtype=dtype, count=count, offset=offset)
        out[key] = torch.from_numpy(flat.reshape(shape).copy())  # (C order: as the Array's)
    return out


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
    layout = _layout(sent.dtype, shape)
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
    import torch

    wire = _WIRE_NUMPY[dtype]
    located: list[tuple[str, tuple[int, ...], int]] = []
    chunks, others, total = [], {}, 0
    for key, array in record.items():
        found = (layouts[key] if layouts is not None else _data_offset(array)) if array.dtype == wire else None
        if found is None:
            others[key] = array
            continue
        _, shape, count, offset = found
        located.append((key, shape, count))
        chunks.append(memoryview(array.data)[offset:])  # (the data runs to the end of the bytes)
        total += count
    # one copy of every located array, in record order, into one buffer
    buffer = np.empty(total, dtype=_NUMPY_DTYPES[wire])
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


def from_wire(state: Mapping[str, torch.Tensor], dtype: str = "float32") -> dict[str, torch.Tensor]:
    """A state dict received in the wire dtype, back in float32 (other tensors unchanged)."""
    import torch

    out = {}
    for key, tensor in state.items():
        if dtype == "bfloat16" and tensor.dtype == torch.int16:
            tensor = tensor.view(torch.bfloat16)
        out[key] = tensor.float() if tensor.is_floating_point() else tensor
    return out
