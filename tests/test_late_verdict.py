"""A node a round recorded late may be gone: the SuperLink's verdict (server.transport.late_verdicts,
settle_late; HeteroStrategy.judge_late). A SuperNode killed mid-round is reported unavailable by the
SuperLink only when its heartbeats lapse, often after the round's deadline: such a node is a failure
of that round (``node unavailable``), not late; a node that answers after the deadline stays late.
tests/test_killed_supernode.py shows it with a real SuperLink and a SIGKILLed flower-supernode."""

from __future__ import annotations

import json
import math
import time

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode

from fedhm_flwr.config import ConfigError, model_spec, run_options
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy
from fedhm_flwr.server.transport import NODE_UNAVAILABLE, late_verdicts, settle_late


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages need the identity a ServerApp process has (LocalGrid gives it, as in the other tests)."""
    LocalGrid(0, {})


def _sent(node_id: int, message_id: str) -> Message:
    msg = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node_id, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = message_id
    return msg


def _unavailable(to: Message) -> Message:
    reply = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=to)
    reply.metadata.__dict__["_src_node_id"] = 1  # sent by the SuperLink itself, not by the node
    return reply


def test_late_verdicts_fail_only_the_nodes_the_superlink_reports_unavailable():
    a, b, c, other = _sent(11, "ma"), _sent(12, "mb"), _sent(13, "mc"), _sent(14, "mx")
    answer = Message(RecordDict({"config": ConfigRecord({"x": 1})}), reply_to=b)
    crash = Message(Error(code=0, reason="ValueError: boom"), reply_to=c)
    came = [_unavailable(a), answer, crash, _unavailable(other)]
    lost, answered = late_verdicts({"ma": 11, "mb": 12, "mc": 13}, came)
    assert lost == [(11, NODE_UNAVAILABLE)]  # matched to the node asked, not to the SuperLink that answered
    assert answered == [answer, crash]  # answers after the deadline (a reply or the node's own error): late
    assert late_verdicts({"ma": 11}, []) == ([], [])


class _Pulls:
    """A grid whose replies come ``after`` seconds from the start, counting the pulls."""

    def __init__(self, replies: dict[str, tuple[float, Message]]):
        self.replies, self.t0, self.pulls = dict(replies), time.monotonic(), 0

    def pull_messages(self, ids):
        self.pulls += 1
        now = time.monotonic() - self.t0
        due = [mid for mid in ids if mid in self.replies and self.replies[mid][0] <= now]
        return [self.replies.pop(mid)[1] for mid in due]


def test_settle_late_waits_for_the_verdict_at_most_its_wait():
    a, b = _sent(11, "ma"), _sent(12, "mb")
    answer = Message(RecordDict({"config": ConfigRecord({})}), reply_to=b)
    grid = _Pulls({"ma": (0.3, _unavailable(a)), "mb": (0.1, answer)})
    lost, answered = settle_late(grid, {"ma": 11, "mb": 12}, wait=5.0, poll=0.05)
    assert lost == [(11, NODE_UNAVAILABLE)] and answered == [answer]
    assert time.monotonic() - grid.t0 < 2.0  # it stopped once both were settled, long before its wait
    # no wait (a simulation): one pull, and a verdict not yet given is no failure
    grid = _Pulls({"ma": (0.5, _unavailable(a))})
    assert settle_late(grid, {"ma": 11}, wait=0.0) == ([], []) and grid.pulls == 1
    # the wait is a bound: a node still silent at its end stays late
    grid = _Pulls({"ma": (9.0, _unavailable(a))})
    t0 = time.monotonic()
    assert settle_late(grid, {"ma": 11}, wait=0.3, poll=0.1) == ([], [])
    assert 0.3 <= time.monotonic() - t0 < 1.5


class _Silent(LocalGrid):
    """A LocalGrid on which partition ``pid``'s round-1 training reply comes ``after`` seconds after the first
    pull of it: the node's
    own answer, or (``gone``) the SuperLink's ``Node Unavailable``, as for a SuperNode killed mid-round."""

    def __init__(self, *args, pid: int, after: float, gone: bool, **kwargs):
        """``after=math.inf``: the reply comes once round 2's messages went out (after round 1 ended, whatever
        the machine's speed)."""
        super().__init__(*args, **kwargs)
        self.pid, self.after, self.gone = pid, after, gone
        self.held: dict[str, tuple[float, Message]] = {}

    def _deliver(self, msg):
        reply = super()._deliver(msg)
        pid = self.contexts[msg.metadata.dst_node_id].node_config["partition-id"]
        config = msg.content["config"]
        if config.get("server-round") == 2 and self.after == math.inf:
            self.held = {m: (-math.inf, held) for m, (_, held) in self.held.items()}  # due at the next pull
        if (config.get("server-round"), msg.metadata.message_type, pid) != (1, MessageType.TRAIN, self.pid):
            return reply
        self.held[msg.metadata.message_id] = (math.inf, _unavailable(msg) if self.gone else reply)
        return None

    def pull_messages(self, message_ids):
        ids, now = list(message_ids), time.monotonic()
        for m in set(ids) & {m for m, (due, _) in self.held.items() if due == math.inf}:  # the clock starts
            self.held[m] = (now + self.after, self.held[m][1])  # at the first pull (this grid trains at the push)
        due = [m for m in ids if m in self.held and self.held[m][0] <= now]
        return [*super().pull_messages(ids), *(self.held.pop(m)[1] for m in due)]


def _two_rounds(toy_cfg, gone: bool, verdict_wait: float, after: float = 2.0) -> list[dict]:
    cfg = toy_cfg("rounds=2 evaluation.where=server evaluation.levels=false evaluation.deploy_stats=false")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    strategy.wire.verdict_wait = verdict_wait
    grid = _Silent(6, client_handlers(), pid=2, after=after, gone=gone)
    arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
    strategy.start(grid, arrays, num_rounds=2, timeout=0.4)  # its deadline comes before the reply
    return strategy.history


def test_a_late_node_the_superlink_then_reports_unavailable_is_a_failure_of_its_round(toy_cfg):
    first, second = _two_rounds(toy_cfg, gone=True, verdict_wait=5.0)
    assert first["sampled"] == 6 and first["replies"] == 5
    assert first["failures"] == 1 and json.loads(first["failure_reasons"]) == [["p2", "node unavailable"]]
    assert "late" not in first and "late_nodes" not in first
    assert second["failures"] == 0 and "late_arrivals" not in second  # the verdict is not counted twice


def test_a_node_that_answers_after_the_deadline_stays_late(toy_cfg):
    first, second = _two_rounds(toy_cfg, gone=False, verdict_wait=5.0)
    assert first["failures"] == 0 and "failure_reasons" not in first
    assert first["late"] == 1 and json.loads(first["late_nodes"]) == ["p2"]
    assert second["late_arrivals"] == 1 and second["failures"] == 0  # its answer, pulled in the wait, counted once
    # without a wait (a simulation) the record is the same: late, its answer a late arrival of the next round
    first, second = _two_rounds(toy_cfg, gone=False, verdict_wait=0.0, after=math.inf)  # came during round 2
    assert first["late"] == 1 and first["failures"] == 0 and second["late_arrivals"] == 1


def test_by_default_a_silent_device_costs_a_round_its_deadline_and_no_verdict_wait(toy_cfg):
    # the wait is opt-in (stragglers.verdict_seconds): a device silent on purpose must not lengthen every round
    assert run_options(toy_cfg()).stragglers.verdict_seconds == 0.0
    first, _ = _two_rounds(
        toy_cfg, gone=True, verdict_wait=run_options(toy_cfg()).stragglers.verdict_seconds, after=math.inf
    )
    assert first["late"] == 1 and first["failures"] == 0  # the verdict is not awaited: recorded late
    with pytest.raises(ConfigError) as err:
        toy_cfg("stragglers.verdict_seconds=-1")
    assert err.value.field == "stragglers.verdict_seconds"
