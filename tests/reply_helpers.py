"""Training replies of test clients that echo or shift what they received, written as the protocol
says a reply is written (``protocol.train_metrics``: every metric, class counts summing to the
example count): the server refuses anything else (fedhm_flwr/server/replies.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedhm_flwr.core import protocol


def counts_summing_to(counts: Sequence[int], n: int) -> list[int]:
    """Class counts holding the classes ``counts`` holds (above zero), summing to ``n``: one example of
    each held class, the rest in the first held one."""
    held = [i for i, c in enumerate(counts) if c > 0]
    assert len(held) <= n, "need at least one example per held class"
    out = [1 if c > 0 else 0 for c in counts]
    out[held[0]] += n - len(held)
    return out


def reply(
    msg: Message,
    state: Mapping[str, torch.Tensor],
    n: int,
    counts: Sequence[int],
    loss: float = 1.0,
    accuracy: float = 0.5,
) -> Message:
    """A reply to ``msg`` holding ``state`` (float32 on the wire) and complete training metrics: ``n``
    examples over the classes ``counts`` holds, at the level ``msg`` was sent."""
    level = float(msg.content[protocol.CONFIG][protocol.LEVEL])
    metrics = protocol.train_metrics(n, loss, accuracy, 0.0, level, counts_summing_to(counts, n))
    arrays = ArrayRecord.from_torch_state_dict({k: v.detach().float().contiguous() for k, v in state.items()})
    return Message(RecordDict({protocol.ARRAYS: arrays, protocol.METRICS: metrics}), reply_to=msg)
