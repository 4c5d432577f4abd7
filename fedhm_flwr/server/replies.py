"""A round's training replies: untrusted input, checked against what each node was sent.

Everything a device sends is read here before the round uses it, and nothing it sends can raise out
of the round (docs/ROBUSTNESS.md, "Malformed replies"):

* **who**: a reply must answer one of this round's messages (an unsolicited one is refused) and
  counts once per node (a second delivery is refused as a duplicate);
* **what**: exactly the records ``arrays`` (an ArrayRecord) and ``metrics`` (a MetricRecord); the
  arrays are the keys the node was sent, each with the dtype, declared shape and byte length of
  the Array it was sent (:func:`fedhm_flwr.server.reply_arrays.sent_layout`, before any tensor is
  read); the tensors then pass the screen (NaN/inf, norm, :meth:`fedhm_flwr.server.untrusted.Untrusted.screen`);
* **the metrics** have the wire types ``train_metrics`` writes (:data:`TRAIN_METRICS`), are finite
  and plausible: ``num-examples`` a positive int no larger than the training examples the node
  reported when it joined, ``class-counts`` that many non-negative ints, one per class, ``level``
  the level it was sent; no other key;
* the **weight** a sample-weighted merge gives the reply is its example count capped at what the
  node reported when it joined and at ``aggregation.max_examples`` (:func:`examples_cap`): a node
  cannot raise its weight by what it says in a reply.

Any exception while checking one reply becomes that reply's refusal with its reason.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.core import protocol as wire
from fedhm_flwr.core.protocol import ARRAYS, METRICS
from fedhm_flwr.data.catalog import DATASETS
from fedhm_flwr.server.payloads import Payload
from fedhm_flwr.server.reply_arrays import reply_tensors, sent_layout
from fedhm_flwr.server.transport import Deadline, asked_ids, content_bytes, error_reason

#: the metrics a training reply holds (``protocol.train_metrics``) -> the Python types each may have
#: on the wire; ``ray-node`` is optional (simulation only), every other key is required
TRAIN_METRICS: dict[str, tuple[type, ...]] = {
    wire.NUM_EXAMPLES: (int,),
    wire.TRAIN_LOSS: (float, int),
    wire.TRAIN_ACCURACY: (float, int),
    wire.SECONDS: (float, int),
    wire.LEVEL: (float, int),
    wire.CLASS_COUNTS: (list,),
    wire.RAY_NODE: (int,),
}
OPTIONAL_METRICS = frozenset({wire.RAY_NODE})


def examples_cap(opts: RunOptions) -> int | None:
    """The most training examples a reply's weight may count: ``aggregation.max_examples`` when set,
    else the training-set size the data spec names when the project knows it (no node holds more
    than the whole training set), else None (only the node's own join-time count bounds it)."""
    configured = opts.aggregation.max_examples
    if configured is not None:
        return configured
    info = DATASETS.get(opts.dataset.name)
    if info is None:
        return None
    limit = opts.dataset.max_train_examples
    return min(info.num_train, limit) if limit > 0 else info.num_train


def _metric_problem(metrics: Mapping[str, Any], level: float, num_classes: int) -> str | None:
    """Why a training reply's metrics do not have the documented form, or None."""
    unknown = sorted(set(metrics) - set(TRAIN_METRICS))
    if unknown:
        return f"unexpected metrics {unknown[:3]}"
    missing = sorted(set(TRAIN_METRICS) - set(metrics) - OPTIONAL_METRICS)
    if missing:
        return f"metrics lack {missing[:3]}"
    for key, value in metrics.items():
        if type(value) not in TRAIN_METRICS[key]:
            kinds = " or ".join(t.__name__ for t in TRAIN_METRICS[key])
            return f"{key} is {type(value).__name__} ({value!r:.40}), must be {kinds}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key} is not finite ({value!r})"
    n = metrics[wire.NUM_EXAMPLES]
    if not 0 < n < 2**63:
        return f"num-examples must be a positive integer, got {n}"
    counts = metrics[wire.CLASS_COUNTS]
    if not (len(counts) == num_classes and all(type(c) is int and 0 <= c < 2**63 for c in counts)):
        return f"class-counts must hold {num_classes} non-negative integer counts"
    if sum(counts) != n:
        return f"class-counts sum to {sum(counts)}, num-examples is {n}"
    if not 0.0 <= metrics[wire.TRAIN_ACCURACY] <= 1.0:
        return f"train-accuracy {metrics[wire.TRAIN_ACCURACY]!r} is not in [0, 1]"
    if metrics[wire.SECONDS] < 0:
        return f"seconds {metrics[wire.SECONDS]!r} is negative"
    if float(metrics[wire.LEVEL]) != float(level):
        return f"level {metrics[wire.LEVEL]!r} is not the level {level:g} the node was sent"
    if not 0 <= metrics.get(wire.RAY_NODE, 0) < 2**48:
        return "ray-node is not a 48-bit node number"
    return None


Checked = tuple[dict[str, torch.Tensor], int, np.ndarray, dict[str, float]]


def check_train_reply(
    content: RecordDict,
    payload: Payload,
    level: float,
    num_classes: int,
    dtype: str,
    screen: Callable[[dict[str, torch.Tensor], torch.Tensor | None], str | None],
    joined: int | None = None,
    cap: int | None = None,
) -> tuple[Checked | None, str]:
    """A training reply checked against the payload sent: ((state in float32, the weight's example
    count, class counts, scalar metrics), "") or (None, why it is refused). Records, metrics, keys,
    dtypes, shapes and byte lengths are checked before any tensor is read; ``screen(state, flat)``
    then refuses tensors (NaN/inf, oversized; ``flat``: every floating value of the reply in one
    tensor, or None). ``joined``: the training examples the node reported when it joined (None:
    unknown); ``cap``: :func:`examples_cap`."""
    if set(content.keys()) != {ARRAYS, METRICS}:
        return None, f"reply records are {sorted(content.keys())[:4]}, must be exactly ['{ARRAYS}', '{METRICS}']"
    record, metrics = content[ARRAYS], content[METRICS]
    if not isinstance(record, ArrayRecord) or not isinstance(metrics, MetricRecord):
        return None, f"'{ARRAYS}' must be an ArrayRecord and '{METRICS}' a MetricRecord"
    problem = _metric_problem(metrics, level, num_classes)
    if problem:
        return None, problem
    checked: Mapping[str, Any] = metrics  # of the forms _metric_problem checked
    n: int = checked[wire.NUM_EXAMPLES]
    if joined is not None and n > joined:
        return None, f"num-examples {n} exceeds the {joined} training examples the node reported when it joined"
    expected, got = payload.expected_keys(), record.keys()
    if expected != got:
        missing, extra = sorted(expected - got), sorted(got - expected)
        return None, f"keys do not match level {level:g}: missing {missing[:3]}, unexpected {extra[:3]}"
    layouts = {}
    for key, array in record.items():  # dtypes, shapes and byte lengths before any tensor is read
        found = sent_layout(array, payload.arrays[key])
        if isinstance(found, str):
            return None, f"{key} {found}"
        layouts[key] = found
    state, flat = reply_tensors(record, dtype, layouts)  # back to float32
    refused = screen(state, flat)
    if refused:
        return None, refused
    weight = min([n, *(bound for bound in (joined, cap) if bound is not None)])
    scalars = {k: float(v) for k, v in checked.items() if k != wire.CLASS_COUNTS}
    return (state, weight, np.asarray(checked[wire.CLASS_COUNTS], dtype=np.int64), scalars), ""


@dataclass
class Sorted:
    """A round's replies sorted: the valid ones (as ``validate`` made them) and the refused ones."""

    valid: list[Any] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (node, why): error replies
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (node, why): refused replies
    answered: set[int] = field(default_factory=set)  # nodes that answered their message (any way)
    late: int = 0  # answers to an earlier round's messages (that round stopped waiting for them)
    received_bytes: int = 0


def sort_replies(
    messages: Sequence[Message],
    replies: Iterable[Message],
    validate: Callable[[int, Message], tuple[Any, str]],
    earlier: Iterable[str] = (),
) -> Sorted:
    """Each reply to these pushed ``messages``, matched to the message it answers (never to its
    sender: the SuperLink answers for a node that missed its heartbeats; a message never pushed, which
    has no id, is matched by the node it went to: :func:`fedhm_flwr.server.transport.asked_ids`): an error reply is a
    failure; a reply to none of the messages, or a node's second one, is refused; the others go
    through ``validate(node, reply)`` -> (valid reply, "") or (None, why); whatever it raises is
    that reply's refusal. An answer to one of the ``earlier`` message ids (an earlier round's, which
    stopped waiting for it) is counted late and dropped. Every reply that arrived counts its bytes,
    refused ones included."""
    asked, unpushed = asked_ids(messages)
    out, late = Sorted(), set(earlier)
    for msg in replies:
        node_id = asked.get(msg.metadata.reply_to_message_id)
        if node_id is None and msg.metadata.src_node_id in unpushed:
            node_id = msg.metadata.src_node_id
        with contextlib.suppress(Exception):  # a record Flower cannot count is refused below, or was an error
            out.received_bytes += content_bytes(msg.content) if msg.has_content() else 0
        if node_id is None and msg.metadata.reply_to_message_id in late:
            out.late += 1
            continue
        if node_id is None:
            out.rejected.append((msg.metadata.src_node_id, "unsolicited reply: it answers no message of this round"))
            continue
        if node_id in out.answered:
            out.rejected.append((node_id, "duplicate reply: the node answered this round already"))
            continue
        out.answered.add(node_id)
        if msg.has_error():
            out.failures.append((node_id, error_reason(msg)))
            continue
        try:
            valid, why = validate(node_id, msg)
        except Exception as exc:  # noqa: BLE001 (no reply can raise out of the round)
            valid, why = None, f"reply could not be read: {type(exc).__name__}: {exc}"
        if valid is None:
            out.rejected.append((node_id, why))
        else:
            out.valid.append(valid)
    return out


def round_deadline(opts: RunOptions, timeout: float | None = None) -> Deadline:
    """When a round's exchange stops waiting (``stragglers.*``, never after ``timeout``, default the
    run's): :class:`fedhm_flwr.server.transport.Deadline`."""
    s = opts.stragglers
    return Deadline(float(opts.timeout if timeout is None else timeout), s.quorum, s.factor, s.min_seconds)
