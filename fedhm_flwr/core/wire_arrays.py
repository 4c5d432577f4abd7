"""Model tensors on the wire: a tensor as a Flower ``Array`` in the wire dtype (``wire.dtype``) and
back, byte for byte what Flower itself would write and read. Part of the wire contract
(:mod:`fedhm_flwr.core.protocol` re-exports these names); torch is imported where tensors are converted,
since the config check imports the protocol without torch. The server's checks of a reply's Arrays
against those it sent are :mod:`fedhm_flwr.server.reply_arrays`.
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
NUMPY_DTYPES = {
    name: np.dtype(name)
    for name in ("float32", "float16", "float64", "int16", "int32", "int64", "uint8", "int8", "bool")
}
_DTYPE_NAMES = {dtype: name for name, dtype in NUMPY_DTYPES.items()}  # (and back)


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


def array_layout(name: str, shape: tuple[int, ...]) -> tuple[np.dtype, int, bytes | None, int] | None:
    key = (name, shape)
    if key not in _LAYOUTS:
        try:
            dtype = NUMPY_DTYPES.get(name) or np.dtype(name)
        except TypeError:
            dtype = None
        if dtype is None or dtype.hasobject:
            _LAYOUTS[key] = None
        else:
            count = math.prod(shape)
            header = npy_header(name, shape)
            _LAYOUTS[key] = (dtype, count, header, (len(header) if header else 0) + dtype.itemsize * count)
    return _LAYOUTS[key]


def data_offset(array: Any) -> tuple[np.dtype, tuple[int, ...], int, int] | None:
    """(numpy dtype, shape, element count, offset of the data in ``array.data``) of an Array whose
    bytes are a ``.npy`` header declaring its own dtype and shape in C order followed by the data;
    None for anything else (read through ``Array.numpy()``). The header :func:`npy_header` makes
    for the dtype and shape is recognised as it is; a header differing only in its padding or form
    (another numpy's ``np.save``) by what it declares, the data then read from the end of the bytes
    (where ``np.save`` puts it)."""
    if array.stype != "numpy.ndarray" or not isinstance(array.dtype, str):
        return None
    shape, data = tuple(array.shape), array.data
    layout = array_layout(array.dtype, shape)
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
    of a round's aggregation at ResNet-18 size); here an array :func:`data_offset` locates is read
    from after its header; anything else goes through ``Array.numpy()``."""
    import torch

    out = {}
    for key, array in record.items():
        located = data_offset(array)
        if located is None:
            out[key] = torch.from_numpy(array.numpy())
            continue
        dtype, shape, count, offset = located
        flat = np.frombuffer(array.data, dtype=dtype, count=count, offset=offset)
        out[key] = torch.from_numpy(flat.reshape(shape).copy())  # (C order: as the Array's)
    return out


def from_wire(state: Mapping[str, torch.Tensor], dtype: str = "float32") -> dict[str, torch.Tensor]:
    """A state dict received in the wire dtype, back in float32 (other tensors unchanged)."""
    import torch

    out = {}
    for key, tensor in state.items():
        if dtype == "bfloat16" and tensor.dtype == torch.int16:
            tensor = tensor.view(torch.bfloat16)
        out[key] = tensor.float() if tensor.is_floating_point() else tensor
    return out
