"""The server's own encode/decode of arrays (fedhm_flwr/core/protocol.py) against Flower's and numpy's:
the bytes it sends are the ones ``Array.from_torch_tensor`` would send, what it reads is what
``Array.numpy()`` reads, whatever numpy wrote the header; and FedHM's per-version cut of a level's
state is recut when the global state changes, in place included."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedhm_flwr.config import model_spec, run_options
from fedhm_flwr.core import protocol
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy
from fedhm_flwr.server.reply_arrays import reply_tensors

TENSORS = [
    torch.randn(3, 4),
    torch.randn(()),
    torch.zeros(0, 5),
    torch.randint(-9, 9, (7,)),
    torch.rand(4) > 0.5,
    torch.randn(16, 8, 3, 3),
    torch.randn(5, 3).t(),
    torch.randn(2, 3, dtype=torch.float64),
]


@pytest.mark.parametrize("dtype", protocol.WIRE_DTYPES)
def test_wire_arrays_are_byte_for_byte_flowers(dtype):
    for tensor in TENSORS:
        expected = tensor.detach()
        if expected.is_floating_point():
            expected = expected.to(getattr(torch, dtype))
            if dtype == "bfloat16":
                expected = expected.view(torch.int16)
        ours, flowers = protocol.wire_array(tensor, dtype), Array.from_torch_tensor(expected.contiguous())
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (
            flowers.dtype,
            flowers.shape,
            flowers.stype,
            flowers.data,
        )


def test_replies_read_alike_whatever_wrote_their_header():
    record = protocol.array_record({str(i): protocol.wire_array(t) for i, t in enumerate(TENSORS)})
    # a header numpy did not write for this dtype and shape (other padding, format 2.0), and a lie
    plain = np.arange(6, dtype=np.float32).reshape(2, 3)
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, plain, version=(2, 0))
    record["v2"] = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=buffer.getvalue())
    fortran = io.BytesIO()
    np.save(fortran, np.asfortranarray(plain))
    record["fortran"] = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=fortran.getvalue())
    read = protocol.record_tensors(record)
    for key, array in record.items():
        assert read[key].dtype == torch.from_numpy(array.numpy()).dtype
        assert torch.equal(read[key], torch.from_numpy(array.numpy())), key
    assert torch.equal(read["v2"], torch.from_numpy(plain)) and torch.equal(read["fortran"], torch.from_numpy(plain))


@pytest.mark.parametrize("dtype", protocol.WIRE_DTYPES)
def test_a_reply_reads_into_one_flat_float32_tensor_as_it_reads_tensor_by_tensor(dtype):
    """``reply_tensors`` gives what ``from_wire(record_tensors(...))`` gives, key for key, value for
    value and dtype for dtype, and its flat tensor holds every floating value in record order; an
    array outside the wire dtype keeps its own way in, and the flat tensor is then withheld."""
    honest = protocol.array_record({str(i): protocol.wire_array(t, dtype) for i, t in enumerate(TENSORS[:6])})
    expected = protocol.from_wire(protocol.record_tensors(honest), dtype)
    read, flat = reply_tensors(honest, dtype)
    assert list(read) == list(expected)
    for key, tensor in expected.items():
        assert read[key].dtype == tensor.dtype and read[key].shape == tensor.shape and torch.equal(read[key], tensor), (
            key
        )
    floats = [t.reshape(-1) for t in expected.values() if t.is_floating_point()]
    assert flat is not None and flat.dtype == torch.float32 and torch.equal(flat, torch.cat(floats))
    assert all(read[k].data_ptr() != read[j].data_ptr() for k in read for j in read if k < j and read[k].numel())
    odd = protocol.array_record(dict(honest.items()))
    odd["f64"] = Array.from_numpy_ndarray(np.arange(6, dtype=np.float64).reshape(2, 3))  # (a sender's own dtype)
    read, flat = reply_tensors(odd, dtype)
    expected = protocol.from_wire(protocol.record_tensors(odd), dtype)
    assert flat is None and list(read) == list(expected) and all(torch.equal(read[k], expected[k]) for k in expected)
    empty, flat = reply_tensors(protocol.array_record({}), dtype)
    assert empty == {} and flat is not None and flat.numel() == 0


def test_records_share_the_payloads_arrays_but_not_their_keys():
    arrays = {"w": protocol.wire_array(torch.randn(3))}
    first, second = protocol.array_record(arrays), protocol.array_record(arrays)
    assert first["w"] is second["w"] is arrays["w"]
    first["extra"] = protocol.wire_array(torch.zeros(1))
    assert list(second.keys()) == ["w"] and isinstance(second, ArrayRecord)


def test_a_levels_cut_follows_the_global_state_in_place_changes_included(toy_cfg):
    cfg = toy_cfg("")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    state = initial_state(cfg.seed, strategy.method.spec)
    level = next(i for i, ranks in enumerate(strategy.method.ranks) if ranks)
    name = sorted(strategy.method.ranks[level])[0]
    first = strategy.method.level_payload(level, state)[1]
    again = strategy.method.level_payload(level, state)[1]
    assert all(again[k] is first[k] for k in first)  # one cut per model version
    with torch.no_grad():
        state[f"{name}.weight"].mul_(2.0)  # in place: the same tensor, a new version
    changed = strategy.method.level_payload(level, state)[1]
    a, b = f"{name}.a.weight", f"{name}.b.weight"
    assert not torch.equal(changed[a], first[a])
    # the cut of the changed weight is the cut a fresh strategy makes of it
    fresh = FedHMStrategy(run_options(cfg), model_spec(cfg)).method.level_payload(
        level, {k: v.clone() for k, v in state.items()}
    )[1]
    assert torch.equal(changed[a], fresh[a]) and torch.equal(changed[b], fresh[b])
    replaced = dict(state, **{f"{name}.weight": state[f"{name}.weight"] / 2})  # a new tensor
    assert torch.equal(strategy.method.level_payload(level, replaced)[1][a], first[a])
