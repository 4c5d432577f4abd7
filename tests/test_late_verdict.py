"""A node a round recorded late may be gone: the SuperLink's verdict (server.transport.late_verdicts,
settle_late; server.late; HeteroStrategy.amend). A SuperNode killed mid-round is reported unavailable by
the SuperLink only when its heartbeats lapse, often after the round's deadline. No round waits for that:
the verdict comes with a later round's replies (or in the wait after the last round, on devices) and
amends the earlier round's record: one failure (``node unavailable``), not late. A node that answers
after the deadline stays late, its answer a late arrival. tests/test_killed_supernode.py shows it with a
real SuperLink and a SIGKILLed flower-supernode."""

from __future__ import annotations

import json
import logging
import math
import time

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode

from fedhm_flwr.config import ConfigError, model_spec, run_options
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.reporting.results import RunRecorder, load_checkpoint_state, summarize
from fedhm_flwr.server.late import amend_row
from fedhm_flwr.server.outputs import RunOutputs
from fedhm_flwr.server.registry import FedHMStrategy
from fedhm_flwr.server.transport import HEARTBEAT_VERDICT, NODE_UNAVAILABLE, late_verdicts, settle_late


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
    # mapped to whatever the caller keys a message by (the strategy: the message id, then its round)
    assert late_verdicts({"ma": "ma", "mb": "mb"}, came)[0] == [("ma", NODE_UNAVAILABLE)]


def test_an_amended_row_has_one_more_failure_and_loses_the_node_from_late():
    row = {"round": 2, "failures": 1, "failure_reasons": json.dumps([["p0", "client error: x"]]), "late": 2}
    row.update({"late_nodes": json.dumps(["p1", "p3"]), "late_arrivals": 0})
    amend_row(row, "p1", NODE_UNAVAILABLE, 3)
    assert row["failures"] == 2 and json.loads(row["failure_reasons"])[-1] == ["p1", NODE_UNAVAILABLE]
    assert row["late"] == 1 and json.loads(row["late_nodes"]) == ["p3"] and row["amended_in_round"] == 3
    amend_row(row, "p3", NODE_UNAVAILABLE, None)  # in the wait after the last round
    assert row["failures"] == 3 and row["amended_at_run_end"] is True
    assert not {"late", "late_nodes", "late_arrivals"} & set(row)  # as round_row writes a round with none
    # a late arrival the round counted keeps the keys (round_row writes them while either is non-zero)
    row = {"round": 1, "failures": 0, "late": 1, "late_nodes": json.dumps(["p1"]), "late_arrivals": 2}
    amend_row(row, "p1", NODE_UNAVAILABLE, 2)
    assert (row["late"], json.loads(row["late_nodes"]), row["late_arrivals"]) == (0, [], 2)


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
    """A LocalGrid on which partition ``pid``'s round-1 training reply comes ``after`` seconds after the
    first pull of it (``math.inf``: at the first pull once round 2's messages went out, after round 1
    ended, whatever the machine's speed): the node's own answer, or (``gone``) the SuperLink's ``Node
    Unavailable``, as for a SuperNode killed mid-round. Its pulls are counted."""

    def __init__(self, *args, pid: int, after: float, gone: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.pid, self.after, self.gone, self.pulls = pid, after, gone, 0
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
        self.pulls += 1
        ids, now = list(message_ids), time.monotonic()
        for m in set(ids) & {m for m, (due, _) in self.held.items() if due == math.inf}:  # the clock starts
            self.held[m] = (now + self.after, self.held[m][1])  # at the first pull (this grid trains at the push)
        due = [m for m in ids if m in self.held and self.held[m][0] <= now]
        return [*super().pull_messages(ids), *(self.held.pop(m)[1] for m in due)]


class _Outputs(RunOutputs):
    """The ServerApp's outputs, noting when the last round's row was closed and the grid's pulls then."""

    grid: _Silent | None = None
    closed_at, pulls_then = math.inf, 0

    def closed(self, end, row):
        super().closed(end, row)
        self.closed_at, self.pulls_then = time.monotonic(), self.grid.pulls if self.grid else 0


def _run(toy_cfg, tmp_path, gone: bool, after: float, verdict_wait: float | None, rounds: int = 2):
    """(the strategy's history, the rows on disk, seconds from the last row to the run's end, pulls then)
    of a run whose partition 2 is late in round 1 (deadline 0.4 s); ``verdict_wait`` None: a simulation's."""
    cfg = toy_cfg(f"rounds={rounds} evaluation.where=server evaluation.levels=false evaluation.deploy_stats=false")
    opts = run_options(cfg)
    recorder = RunRecorder(tmp_path / "run")
    outputs = _Outputs(opts, recorder)
    strategy = FedHMStrategy(opts, model_spec(cfg), outputs=outputs)
    if verdict_wait is not None:  # as the ServerApp does on devices
        strategy.wire.verdict_wait = verdict_wait
    grid = outputs.grid = _Silent(6, client_handlers(), pid=2, after=after, gone=gone)
    arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec))
    strategy.start(grid, arrays, num_rounds=rounds, timeout=0.4)  # its deadline comes before the reply
    ended = time.monotonic() - outputs.closed_at
    disk = [json.loads(line) for line in (recorder.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert summarize(disk, {})["failures"] == sum(r["failures"] for r in strategy.history)  # what the summary sums
    return strategy.history, disk, ended, grid.pulls - outputs.pulls_then


def test_a_verdict_in_a_later_round_amends_the_earlier_rounds_record(toy_cfg, tmp_path, caplog):
    # the SuperLink's Node Unavailable for p2's round-1 message comes with round 2's replies
    with caplog.at_level(logging.INFO, logger="flwr"):
        (first, second), disk, _, _ = _run(toy_cfg, tmp_path, gone=True, after=math.inf, verdict_wait=None)
    said = "round 2: node p2 failed in round 1: node unavailable (its SuperNode was lost); round 1's record amended"
    assert caplog.text.count(said) == 1
    assert first["sampled"] == 6 and first["replies"] == 5
    assert first["failures"] == 1 and json.loads(first["failure_reasons"]) == [["p2", "node unavailable"]]
    assert "late" not in first and "late_nodes" not in first and first["amended_in_round"] == 2
    assert second["failures"] == 0 and "late_arrivals" not in second  # the verdict is not counted twice
    assert "amended_in_round" not in second
    assert disk[0] == first and disk[1] == second  # metrics.jsonl rewritten with the amended row
    assert summarize(disk, {})["failures"] == 1
    assert "amended_in_round" in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]


def test_a_node_that_answers_after_the_deadline_stays_late(toy_cfg, tmp_path):
    (first, second), disk, _, _ = _run(toy_cfg, tmp_path, gone=False, after=math.inf, verdict_wait=HEARTBEAT_VERDICT)
    assert first["failures"] == 0 and "failure_reasons" not in first and "amended_in_round" not in first
    assert first["late"] == 1 and json.loads(first["late_nodes"]) == ["p2"]
    assert second["late_arrivals"] == 1 and second["failures"] == 0  # its answer, pulled in round 2, counted once
    assert disk == [first, second] and summarize(disk, {})["failures"] == 0


def test_a_silent_node_never_makes_a_round_wait_and_the_end_waits_at_most_verdict_seconds(toy_cfg, tmp_path):
    wait = 4.0
    rows, _, ended, pulls = _run(toy_cfg, tmp_path, gone=True, after=1e9, verdict_wait=wait)  # never judged
    assert rows[0]["late"] == 1 and rows[0]["failures"] == 0  # no verdict: it stays late
    assert all(r["seconds"] < wait for r in rows), [r["seconds"] for r in rows]  # no round waited for it
    assert wait <= ended < wait + 2.5 and pulls >= 2  # the run's end pulled it again and again, then gave up


def test_the_run_end_waits_only_for_pending_nodes_and_a_simulation_never_waits(toy_cfg, tmp_path):
    # p2's answer came in round 2: nothing is pending, the end does not wait (even 62 s on devices)
    _, _, ended, pulls = _run(toy_cfg, tmp_path / "a", gone=False, after=math.inf, verdict_wait=HEARTBEAT_VERDICT)
    assert ended < 1.5 and pulls == 0
    # a simulation (no verdict_wait set): one pull at the end, whatever is still pending
    rows, _, ended, pulls = _run(toy_cfg, tmp_path / "b", gone=True, after=1e9, verdict_wait=None)
    assert ended < 1.5 and pulls == 1 and rows[0]["late"] == 1


def test_a_verdict_in_the_wait_after_the_last_round_amends_that_round(toy_cfg, tmp_path):
    # one round: p2's Node Unavailable comes 1 s after its first pull, long after the 0.4 s deadline
    (row,), disk, ended, _ = _run(toy_cfg, tmp_path, gone=True, after=1.0, verdict_wait=30.0, rounds=1)
    assert row["failures"] == 1 and json.loads(row["failure_reasons"]) == [["p2", "node unavailable"]]
    assert "late" not in row and row["amended_at_run_end"] is True and "amended_in_round" not in row
    assert disk == [row] and ended < 10  # it stopped once judged, long before its 30 s
    saved = load_checkpoint_state(tmp_path / "run")  # the last checkpoint (a resume, `fedhm status`) has it too
    assert saved["round"] == 1 and saved["history"] == [row], saved["history"]
    assert json.loads((tmp_path / "run" / "checkpoint" / "strategy_state.json").read_text())["history"] == [row]


def test_the_verdict_wait_is_the_heartbeat_window_by_default(toy_cfg):
    assert run_options(toy_cfg()).stragglers.verdict_seconds == HEARTBEAT_VERDICT == 62.0
    with pytest.raises(ConfigError) as err:
        toy_cfg("stragglers.verdict_seconds=-1")
    assert err.value.field == "stragglers.verdict_seconds"
