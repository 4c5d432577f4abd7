"""What a hostile device sends: malformed training replies, made from the honest reply it would
have sent (``failures.attack.kind=malformed``, and the fuzzing of ``python -m bench.fuzz``).

Each class (:data:`MALFORMED`) turns a reply's records into a reply that is wrong in one way a
device that knows the protocol and the message it received could choose: arrays in another dtype,
bytes that hold another shape than the Array declares, metrics of the wrong wire type or value,
records of the wrong kind. Every class but the :data:`BENIGN` ones must be refused by the server
(:mod:`fedhm_flwr.server.replies`); the benign ones change only how an honest reply is written and
must be accepted. Delivery (a reply sent twice, to no message, or never) is the transport's
business: the fuzzing grid does those.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues

from fedhm_flwr.core.attack_kinds import MALFORMED_KINDS
from fedhm_flwr.core.protocol import (
    ARRAYS,
    CLASS_COUNTS,
    CONFIG,
    LEVEL,
    METRICS,
    NUM_EXAMPLES,
    SECONDS,
    TRAIN_ACCURACY,
    TRAIN_LOSS,
)

Mutation = Callable[[RecordDict, np.random.Generator], RecordDict]


def _arrays_of(content: RecordDict) -> ArrayRecord:
    """The reply's arrays record (an honest reply's: the handlers built it)."""
    return cast(ArrayRecord, content[ARRAYS])


def _metrics_of(content: RecordDict) -> MetricRecord:
    """The reply's metrics record (an honest reply's: the handlers built it)."""
    return cast(MetricRecord, content[METRICS])


def _metric(content: RecordDict, key: str) -> float:
    """A scalar metric of the honest reply (num-examples, level)."""
    return cast(float, content[METRICS][key])


def _class_counts(content: RecordDict) -> list[float]:
    """The honest reply's class counts."""
    return cast("list[float]", content[METRICS][CLASS_COUNTS])


def _npy(values: np.ndarray, version: tuple[int, int] = (1, 0), fortran: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.asfortranarray(values) if fortran else values, version=version)
    return buffer.getvalue()


def _array(values: np.ndarray, **lie: Any) -> Array:
    """An Array of ``values`` as np.save writes it, with any field replaced by ``lie``."""
    fields: dict[str, Any] = {
        "dtype": str(values.dtype),
        "shape": tuple(values.shape),
        "stype": "numpy.ndarray",
        "data": _npy(values),
    }
    fields.update(lie)
    return Array(**fields)


def _with(content: RecordDict, **records: Any) -> RecordDict:
    """A copy of ``content`` with these records set (None: removed)."""
    out = RecordDict({name: record for name, record in content.items() if name not in records})
    for name, record in records.items():
        if record is not None:
            out[name] = record
    return out


def _arrays(
    content: RecordDict, change: Callable[[dict[str, Array], np.random.Generator], None], rng: np.random.Generator
) -> RecordDict:
    arrays = dict(_arrays_of(content).items())
    change(arrays, rng)
    record = ArrayRecord()
    for key, array in arrays.items():
        record[key] = array
    return _with(content, **{ARRAYS: record})


def _metrics(content: RecordDict, **values: Any) -> RecordDict:
    """A copy with these metrics set (a value of None: the metric removed)."""
    metrics = {k: v for k, v in _metrics_of(content).items() if k not in values}
    metrics.update({k: v for k, v in values.items() if v is not None})
    return _with(content, **{METRICS: MetricRecord(metrics)})


def _floating(arrays: dict[str, Array]) -> list[str]:
    return [k for k, a in arrays.items() if np.dtype(a.dtype).kind == "f" or a.dtype == "int16"]


#: the key of the array ``extra-key`` adds (never one a later class picks: it would take it back out)
ROGUE = "rogue.weight"


def _pick(arrays: dict[str, Array], rng: np.random.Generator, min_dim: int = 0) -> str:
    keys = [
        k
        for k in _floating(arrays)
        if k != ROGUE and len(arrays[k].shape) >= min_dim and math.prod(arrays[k].shape) > 0
    ]
    return keys[int(rng.integers(len(keys)))]


def _values(array: Array) -> np.ndarray:
    return array.numpy()


def _int_arrays(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    big = bool(rng.integers(2))
    for key in _floating(arrays):
        values = _values(arrays[key]).astype(np.float64)
        arrays[key] = _array((values * 1e12 if big else np.full_like(values, 3.0)).astype(np.int64))


def _float64(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    key = _pick(arrays, rng)
    arrays[key] = _array(_values(arrays[key]).astype(np.float64))


def _lying_shape(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    """The Array declares the shape it was sent; its bytes hold another (more or fewer elements, or
    the same elements under another shape in the header)."""
    key = _pick(arrays, rng)
    sent = arrays[key]
    values = _values(sent)
    kind = int(rng.integers(3))
    if kind == 0:
        other = np.concatenate(
            [values.reshape(-1), values.reshape(-1)[:1] if values.size else np.zeros(1, values.dtype)]
        )
    elif kind == 1:
        other = values.reshape(-1)[:-1]
    else:
        other = values.reshape(-1) if values.ndim != 1 else values.reshape(1, -1)
    arrays[key] = Array(dtype=sent.dtype, shape=tuple(sent.shape), stype=sent.stype, data=_npy(other))


def _wrong_shape(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    """An array of one more element in its last dimension than the shape it declares (so: than it was
    sent, unless an earlier class changed that already)."""
    key = _pick(arrays, rng)
    shape = tuple(arrays[key].shape)
    arrays[key] = _array(np.zeros((*shape[:-1], shape[-1] + 1) if shape else (2,), np.dtype(arrays[key].dtype)))


def _oversized(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    """Its declared dtype and shape, then megabytes of bytes the server would have to decode."""
    key = _pick(arrays, rng)
    sent = arrays[key]
    junk = bytes(int(rng.integers(1, 9)) << 20)
    arrays[key] = Array(dtype=sent.dtype, shape=tuple(sent.shape), stype=sent.stype, data=sent.data + junk)


def _truncated(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    key = _pick(arrays, rng)
    sent = arrays[key]
    cut = int(rng.integers(1, len(sent.data)))
    arrays[key] = Array(dtype=sent.dtype, shape=tuple(sent.shape), stype=sent.stype, data=sent.data[:cut])


def _bad_header(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    """The right length, but the header is garbage, or declares another dtype of the same size."""
    key = _pick(arrays, rng)
    sent = arrays[key]
    values = _values(sent)
    if rng.integers(2):
        size = len(sent.data) - values.nbytes
        data = bytes(rng.integers(0, 256, size, dtype=np.uint8)) + sent.data[size:]
    else:
        other = next(
            d
            for d in (np.int16, np.float16, np.int32, np.float32, np.int64, np.float64)
            if np.dtype(d).itemsize == values.dtype.itemsize and np.dtype(d) != values.dtype
        )
        data = _npy(values.view(other))
    arrays[key] = Array(dtype=sent.dtype, shape=tuple(sent.shape), stype=sent.stype, data=data)


def _fortran(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    key = _pick(arrays, rng, min_dim=2)
    sent = arrays[key]
    values = _values(sent)
    values = values + np.zeros_like(values) if values.shape[0] > 1 else np.repeat(values, 1, axis=0)
    arrays[key] = Array(dtype=sent.dtype, shape=tuple(sent.shape), stype=sent.stype, data=_npy(values, fortran=True))


def _stype(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    key = _pick(arrays, rng)
    sent = arrays[key]
    arrays[key] = Array(dtype=sent.dtype, shape=tuple(sent.shape), stype="torch.Tensor", data=sent.data)


def _value(fill: float) -> Callable[[dict[str, Array], np.random.Generator], None]:
    def change(arrays: dict[str, Array], rng: np.random.Generator) -> None:
        key = _pick(arrays, rng)
        values = _values(arrays[key]).copy()
        if values.dtype == np.int16:  # bfloat16 on the wire: its raw bits (the top half of a float32's)
            bits = (np.array([fill], np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.int16)[0]
            values.reshape(-1)[int(rng.integers(values.size))] = bits
        else:
            values.reshape(-1)[int(rng.integers(values.size))] = fill
        arrays[key] = _array(values)

    return change


def _extra_key(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    arrays[ROGUE] = _array(np.zeros(2, np.float32))


def _missing_key(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    del arrays[_pick(arrays, rng)]


def _header_v2(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    for key, array in list(arrays.items()):
        arrays[key] = Array(
            dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=_npy(_values(array), version=(2, 0))
        )


def _reordered(arrays: dict[str, Array], rng: np.random.Generator) -> None:
    items = list(arrays.items())
    arrays.clear()
    arrays.update(items[::-1])


def _counts(content: RecordDict, rng: np.random.Generator, kind: str) -> RecordDict:
    counts = list(_class_counts(content))
    if kind == "nan":
        counts = [math.nan] * len(counts)
    elif kind == "short":
        counts = counts[:-1]
    elif kind == "float":
        counts = [float(c) + 0.5 for c in counts]
    elif kind == "negative":
        counts[0] = -1 - counts[0]
    else:  # another total than num-examples
        counts[int(np.argmax(counts))] += 1
    return _metrics(content, **{CLASS_COUNTS: counts})


MUTATIONS: dict[str, tuple[str, Mutation]] = {
    "int-arrays": (
        "every floating array sent back as int64 (values ×1e12, or just 3)",
        lambda c, r: _arrays(c, _int_arrays, r),
    ),
    "float64-array": ("one floating array sent back as float64", lambda c, r: _arrays(c, _float64, r)),
    "lying-shape": (
        "an Array whose bytes hold another shape than its declared shape",
        lambda c, r: _arrays(c, _lying_shape, r),
    ),
    "wrong-shape": ("an array of another shape than the one sent", lambda c, r: _arrays(c, _wrong_shape, r)),
    "oversized-bytes": (
        "an Array of the sent dtype and shape followed by 1-8 MB more bytes",
        lambda c, r: _arrays(c, _oversized, r),
    ),
    "truncated-bytes": ("an Array's bytes cut short", lambda c, r: _arrays(c, _truncated, r)),
    "bad-header": (
        "an Array's .npy header garbage, or declaring another dtype",
        lambda c, r: _arrays(c, _bad_header, r),
    ),
    "fortran-order": ("an Array's bytes in Fortran order", lambda c, r: _arrays(c, _fortran, r)),
    "other-stype": ("an Array of another serialisation type", lambda c, r: _arrays(c, _stype, r)),
    "nan-values": ("a floating value NaN", lambda c, r: _arrays(c, _value(math.nan), r)),
    "inf-values": ("a floating value inf", lambda c, r: _arrays(c, _value(math.inf), r)),
    "huge-values": (
        "a floating value 1e20 (finite, far above aggregation.max_norm)",
        lambda c, r: _arrays(c, _value(1e20), r),
    ),
    "extra-key": ("an array the node was not sent", lambda c, r: _arrays(c, _extra_key, r)),
    "missing-key": ("an array the node was sent left out", lambda c, r: _arrays(c, _missing_key, r)),
    "inf-examples": ("num-examples = inf", lambda c, r: _metrics(c, **{NUM_EXAMPLES: math.inf})),
    "nan-examples": ("num-examples = NaN", lambda c, r: _metrics(c, **{NUM_EXAMPLES: math.nan})),
    "fractional-examples": ("num-examples = 0.5", lambda c, r: _metrics(c, **{NUM_EXAMPLES: 0.5})),
    "float-examples": (
        "num-examples as a float of its own value",
        lambda c, r: _metrics(c, **{NUM_EXAMPLES: float(_metric(c, NUM_EXAMPLES))}),
    ),
    "huge-examples": (
        "num-examples = 10^9 (class counts to match)",
        lambda c, r: _metrics(c, **{NUM_EXAMPLES: 10**9, CLASS_COUNTS: [10**9] + [0] * (len(_class_counts(c)) - 1)}),
    ),
    "zero-examples": ("num-examples = 0", lambda c, r: _metrics(c, **{NUM_EXAMPLES: 0})),
    "negative-examples": ("num-examples = -30", lambda c, r: _metrics(c, **{NUM_EXAMPLES: -30})),
    "missing-examples": ("no num-examples", lambda c, r: _metrics(c, **{NUM_EXAMPLES: None})),
    "list-examples": ("num-examples a list", lambda c, r: _metrics(c, **{NUM_EXAMPLES: [1, 2]})),
    "nan-counts": ("class-counts NaN", lambda c, r: _counts(c, r, "nan")),
    "short-counts": ("one class count too few", lambda c, r: _counts(c, r, "short")),
    "float-counts": ("class counts fractional", lambda c, r: _counts(c, r, "float")),
    "negative-counts": ("a negative class count", lambda c, r: _counts(c, r, "negative")),
    "counts-off": ("class counts that do not sum to num-examples", lambda c, r: _counts(c, r, "off")),
    "nan-loss": ("train-loss = NaN", lambda c, r: _metrics(c, **{TRAIN_LOSS: math.nan})),
    "inf-seconds": ("seconds = inf", lambda c, r: _metrics(c, **{SECONDS: math.inf})),
    "accuracy-above-1": ("train-accuracy = 1.5", lambda c, r: _metrics(c, **{TRAIN_ACCURACY: 1.5})),
    "other-level": (
        "a level other than the one sent",
        lambda c, r: _metrics(c, **{LEVEL: float(_metric(c, LEVEL)) + 0.25}),
    ),
    "extra-metric": ("a metric the protocol does not have", lambda c, r: _metrics(c, **{"weight": 1e9})),
    "extra-record": (
        "a record besides arrays and metrics",
        lambda c, r: _with(c, **{CONFIG: ConfigRecord({"note": "hello"})}),
    ),
    "missing-metrics": ("no metrics record", lambda c, r: _with(c, **{METRICS: None})),
    "missing-arrays": ("no arrays record", lambda c, r: _with(c, **{ARRAYS: None})),
    "metrics-as-config": (
        "the metrics sent as a ConfigRecord",
        lambda c, r: _with(
            c, **{METRICS: ConfigRecord(cast("dict[str, ConfigRecordValues]", dict(_metrics_of(c).items())))}
        ),
    ),
    # benign: how an honest reply may be written; must be accepted
    "header-v2": ("every array's .npy header in format 2.0 (benign)", lambda c, r: _arrays(c, _header_v2, r)),
    "reordered": ("the arrays in another order (benign)", lambda c, r: _arrays(c, _reordered, r)),
    "integer-loss": ("train-loss an int (benign)", lambda c, r: _metrics(c, **{TRAIN_LOSS: 1})),
}
#: the classes that leave the reply valid (written another way): the server must accept them
BENIGN = frozenset({"header-v2", "reordered", "integer-loss"})
assert set(MUTATIONS) == set(MALFORMED_KINDS) | BENIGN, "math.attacks.MALFORMED_KINDS names every malformed class"


def mutate(content: RecordDict, kind: str, rng: np.random.Generator) -> RecordDict:
    """``content`` as class ``kind`` writes it; unchanged where an earlier mutation left nothing the
    class applies to (no arrays record, no floating array; every class applies to an honest reply,
    in every wire dtype: tests/test_hostile_replies.py)."""
    try:
        return MUTATIONS[kind][1](content, rng)
    except Exception:  # noqa: BLE001 (the fuzzer reports a malformed class that left a reply valid)
        return content


def malformed(content: RecordDict, kind: str, rng: np.random.Generator) -> RecordDict:
    """The reply ``content`` made malformed as class ``kind`` says (``random``: a class drawn by ``rng``)."""
    if kind == "random":
        kind = MALFORMED_KINDS[int(rng.integers(len(MALFORMED_KINDS)))]
    return MUTATIONS[kind][1](content, rng)
