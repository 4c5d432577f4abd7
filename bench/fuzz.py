"""``python -m bench.fuzz --minutes N``: a fuzzing campaign against the server's reply checks.

A federation of 6 nodes on the in-process grid (a tiny CNN, the project's own client handlers)
trains once; its honest replies are kept. Every fuzzed round then runs the real strategy's
``configure_train`` and ``aggregate_train`` on replies made from those: each node's reply is left
as it is or given one or two malformed classes of :mod:`fedhm_flwr.client.hostile` (benign ones
included), and delivered once, twice, not at all, or with an unsolicited reply beside it. Each
round must hold (:func:`check_round`): no exception escapes ``aggregate_train``, the global model
stays finite, every reply delivered is counted once (accepted, refused with a reason, or failed),
every malformed or duplicate reply is refused and no reply the node could honestly have sent is.
The campaign cycles through the configurations of :data:`CONFIGS` (methods, defences, DP, wire
dtypes) and writes ``results/fuzz/fuzz.json`` (per class: replies tried, refused, the reasons,
rounds survived, model finite), which docs/ROBUSTNESS.md tabulates (``python -m bench.robustness``).

The mutator is seeded (``--seed``): a campaign is reproducible; tests/test_hostile_replies.py runs a
short one, drawn by Hypothesis, in the fast suite.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict

from bench.results import commit as code_version
from fedhm_flwr.client.hostile import BENIGN, MUTATIONS, mutate
from fedhm_flwr.config import load_config, model_spec, run_options
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "fuzz" / "fuzz.json"
TOY = (
    "num_clients=6 fraction_train=1.0 dataset.max_train_examples=1200 dataset.max_test_examples=300 "
    "model.width=4 train.batch_size=64 evaluation.batch_size=300 stragglers.min_seconds=0"
)
#: the configurations a campaign cycles through (name -> overrides on TOY)
CONFIGS = {
    "fedhm none": "",
    "fedhm clip": "aggregation.robust=clip",
    "fedhm median": "aggregation.robust=median",
    "fedhm krum": "aggregation.robust=krum",
    "fedhm outlier_z": "aggregation.outlier_z=3",
    "fedhm dp": "dp.enabled=true dp.seed=0 dp.clip=1 dp.noise_multiplier=0.5",
    "fedhm float16": "wire.dtype=float16",
    "fedhm bfloat16": "wire.dtype=bfloat16",
    "fedavg": "method=fedavg",
    "heterofl": "method=heterofl",
}
DELIVERIES = ("once", "once", "once", "twice", "never", "error", "unsolicited")
#: the deliveries whose extra reply must be refused, as a class of the report, and what they are
DELIVERY_CLASSES = {"twice": "duplicate-reply", "unsolicited": "unsolicited-reply"}
DELIVERY_WHAT = {
    "duplicate-reply": "the same reply delivered twice",
    "unsolicited-reply": "a reply to no message of the round, beside the node's own",
    "honest": "the honest reply, as trained",
}
DELIVERY_REASONS = ("duplicate reply", "unsolicited reply")


@dataclass
class Federation:
    """A strategy and its nodes' honest training replies (trained once, by the project's handlers)."""

    name: str
    strategy: Any
    grid: LocalGrid
    honest: dict[int, RecordDict]
    arrays: ArrayRecord
    round: int = 1
    ids: int = 0

    @classmethod
    def make(cls, name: str, overrides: str) -> Federation:
        cfg = load_config(f"{TOY} {overrides}")
        spec = model_spec(cfg)
        strategy = STRATEGIES[cfg.method.name](run_options(cfg), spec)
        grid = LocalGrid(int(cfg.num_clients), client_handlers())
        arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, spec))
        threads = torch.get_num_threads()
        try:
            messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
            honest = {r.metadata.src_node_id: r.content for r in grid.send_and_receive(messages)}
        finally:
            torch.set_num_threads(threads)
        return cls(name, strategy, grid, honest, arrays)

    def send(self) -> list[Message]:
        """The next round's training messages, with message ids as the SuperLink gives them."""
        messages = list(self.strategy.configure_train(self.round, self.arrays, ConfigRecord(), self.grid))
        for msg in messages:
            self.ids += 1
            msg.metadata.__dict__["_message_id"] = f"fuzz-{self.round}-{self.ids}"
        return messages


@dataclass
class Plan:
    """What each node of a round sends: malformed classes (none: its honest reply) and a delivery."""

    kinds: dict[int, list[str]] = field(default_factory=dict)
    delivery: dict[int, str] = field(default_factory=dict)
    seed: int = 0


def draw_plan(nodes: list[int], rng: np.random.Generator, hostile: float = 0.5) -> Plan:
    """A seeded plan: each node hostile with probability ``hostile`` (one or two classes), then a delivery."""
    kinds = list(MUTATIONS)
    plan = Plan(seed=int(rng.integers(2**31)))
    for node in nodes:
        if rng.random() < hostile:  # benign ones first: an honest rewrite must not repair a malformation
            drawn = {kinds[int(i)] for i in rng.integers(len(kinds), size=int(rng.integers(1, 3)))}
            plan.kinds[node] = sorted(drawn, key=lambda k: (k not in BENIGN, k))
        plan.delivery[node] = DELIVERIES[int(rng.integers(len(DELIVERIES)))]
    return plan


@dataclass
class Outcome:
    """One fuzzed round: what was sent, what the round made of it, what went wrong."""

    plan: Plan
    rejected: list[tuple[int, str]]
    failures: list[tuple[int, str]]
    accepted: int
    finite: bool
    escaped: str | None = None
    problems: list[str] = field(default_factory=list)


def fuzz_round(fed: Federation, plan: Plan) -> Outcome:
    """One round of ``plan`` through the strategy; its :class:`Outcome` (see :func:`check_round`)."""
    messages = fed.send()
    rng = np.random.default_rng(plan.seed)
    replies: list[Message] = []
    for msg in messages:
        node = msg.metadata.dst_node_id
        content = fed.honest[node]
        for kind in plan.kinds.get(node, []):
            content = mutate(content, kind, rng)
        how = plan.delivery.get(node, "once")
        if how == "error":
            replies.append(Message(Error(code=0, reason="fuzz: the ClientApp raised"), reply_to=msg))
        elif how != "never":
            replies += [Message(content, reply_to=msg)] * (2 if how == "twice" else 1)
        if how == "unsolicited":
            stray = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
            stray.metadata.__dict__["_message_id"] = f"stray-{fed.ids}"
            replies.append(Message(content, reply_to=stray))
    strategy = fed.strategy
    try:
        arrays, metrics = strategy.aggregate_train(fed.round, list(reversed(replies)))
    except Exception:  # noqa: BLE001 (what the campaign exists to find)
        return Outcome(plan, [], [], 0, False, escaped=traceback.format_exc())
    fed.round += 1
    if arrays is not None:
        fed.arrays = arrays
    state = strategy.global_state
    finite = all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())
    log_ = strategy.round_log
    return Outcome(plan, list(log_.rejected), list(log_.failures), int(metrics["replies"]), finite)


def check_round(fed: Federation, outcome: Outcome) -> list[str]:
    """What went wrong in a fuzzed round (empty: nothing): see the module docstring."""
    if outcome.escaped:
        return [f"exception escaped aggregate_train:\n{outcome.escaped}"]
    plan, problems = outcome.plan, []
    if not outcome.finite:
        problems.append("the global model is not finite")
    delivered = sum(
        {"once": 1, "twice": 2, "never": 0, "error": 1, "unsolicited": 2}[plan.delivery.get(n, "once")]
        for n in fed.honest
    )
    counted = outcome.accepted + len(outcome.rejected) + len(outcome.failures)
    if counted != delivered:
        problems.append(f"{delivered} replies delivered, {counted} counted")
    if any(not why for _, why in outcome.rejected + outcome.failures):
        problems.append("a refusal without a reason")
    refused = Counter(n for n, _ in outcome.rejected)
    for node in fed.honest:
        how = plan.delivery.get(node, "once")
        if how in ("never", "error"):
            continue
        bad = any(k not in BENIGN for k in plan.kinds.get(node, []))
        want = int(bad) + (how == "twice") + (how == "unsolicited")
        if refused[node] < want:
            problems.append(
                f"node {node} ({plan.kinds.get(node, [])}, {how}): {refused[node]} refusals, expected {want}"
            )
        elif not bad and refused[node] > want and not fed.strategy.untrusted.active:
            problems.append(
                f"node {node}'s valid reply ({plan.kinds.get(node, [])}) refused: "
                f"{[w for n, w in outcome.rejected if n == node]}"
            )
    return problems


class Tally:
    """The campaign's figures per malformed class (what ``results/fuzz/fuzz.json`` holds)."""

    def __init__(self) -> None:
        self.classes: dict[str, dict[str, Any]] = defaultdict(
            lambda: {
                "tried": 0,
                "refused": 0,
                "accepted": 0,
                "reasons": Counter(),
                "rounds": 0,
                "rounds_survived": 0,
                "model_finite": 0,
            }
        )
        self.replies = self.rounds = self.escaped = self.non_finite = self.malformed = 0
        self.problems: list[str] = []

    def add(self, fed: Federation, outcome: Outcome, problems: list[str]) -> None:
        self.rounds += 1
        self.escaped += outcome.escaped is not None
        self.non_finite += not outcome.finite and outcome.escaped is None
        self.problems += [f"[{fed.name}, round {fed.round}] {p}" for p in problems]
        reasons = defaultdict(list)  # node -> why its reply was refused (not a duplicate, not a stray)
        for node, why in outcome.rejected:
            if not why.startswith(DELIVERY_REASONS):
                reasons[node].append(why)
        seen: set[str] = set()
        for node in fed.honest:
            how = outcome.plan.delivery.get(node)
            if how in ("never", "error"):
                continue
            self.replies += 1 + (how in ("twice", "unsolicited"))
            if how in ("twice", "unsolicited"):  # the second reply: refused as what it is
                delivery = DELIVERY_CLASSES[how]
                row = self.classes[delivery]
                row["tried"] += 1
                stray = [w for n, w in outcome.rejected if n == node and w.startswith(DELIVERY_REASONS)]
                row["refused" if stray else "accepted"] += 1
                if stray:
                    row["reasons"][stray[0]] += 1
                if delivery not in seen:
                    seen.add(delivery)
                    row["rounds"] += 1
                    row["rounds_survived"] += outcome.escaped is None
                    row["model_finite"] += outcome.finite
            kinds = outcome.plan.kinds.get(node, []) or ["honest"]
            self.malformed += any(k in MUTATIONS and k not in BENIGN for k in kinds)
            for kind in kinds:
                row = self.classes[kind]
                row["tried"] += 1
                refused = bool(reasons.get(node))
                row["refused" if refused else "accepted"] += 1
                if refused and len(kinds) == 1:  # (a reply of two classes is refused for the first found)
                    row["reasons"][_general(reasons[node][0])] += 1
                if kind not in seen:
                    seen.add(kind)
                    row["rounds"] += 1
                    row["rounds_survived"] += outcome.escaped is None
                    row["model_finite"] += outcome.finite

    def report(self, minutes: float, configs: list[str]) -> dict[str, Any]:
        version = code_version()  # "abc1234", or "abc1234 (with uncommitted changes)"
        commit, dirty = version.split()[0], "uncommitted" in version
        what = {**{k: v[0] for k, v in MUTATIONS.items()}, **DELIVERY_WHAT}
        classes = [
            {
                "class": k,
                "what": what[k],
                **{f: v for f, v in self.classes[k].items() if f != "reasons"},
                "reasons": dict(self.classes[k]["reasons"].most_common(5)),
            }
            for k in what
            if k in self.classes
        ]
        return {
            "commit": commit,
            "dirty": dirty,
            "minutes": round(minutes, 2),
            "replies_tried": self.replies,
            "malformed_replies": self.malformed,
            "rounds": self.rounds,
            "configs": configs,
            "escaped": self.escaped,
            "non_finite_models": self.non_finite,
            "problems": self.problems[:20],
            "classes": classes,
        }


def _general(reason: str) -> str:
    """A refusal reason without its reply-specific numbers, shapes and values (so that reasons of one
    kind count together): every number becomes N."""
    return _NUMBER.sub("N", reason)[:120]


#: a number standing alone (not part of a name like conv1.weight or float32)
_NUMBER = re.compile(r"(?<![\w.])[-+]?(\d+\.?\d*(e[-+]?\d+)?|nan|inf)(?![\w])")


def campaign(minutes: float, seed: int = 0, configs: dict[str, str] | None = None, say: Any = print) -> dict[str, Any]:
    """Fuzzed rounds for ``minutes``, cycling through the configurations; the report."""
    configs = configs or CONFIGS
    rng = np.random.default_rng(seed)
    tally = Tally()
    t0 = time.monotonic()
    feds: dict[str, Federation] = {}
    names = list(configs)
    turn = 0
    while time.monotonic() - t0 < 60 * minutes:
        name = names[turn % len(names)]
        turn += 1
        if name not in feds:
            say(f"[fuzz] {name}: training the honest replies")
            feds[name] = Federation.make(name, configs[name])
        fed = feds[name]
        for _ in range(25):
            outcome = fuzz_round(fed, draw_plan(list(fed.honest), rng))
            tally.add(fed, outcome, check_round(fed, outcome))
        say(
            f"[fuzz] {time.monotonic() - t0:6.0f}s  {tally.rounds} rounds, {tally.replies} replies, "
            f"{tally.escaped} escaped, {tally.non_finite} non-finite, {len(tally.problems)} problems"
        )
    return tally.report((time.monotonic() - t0) / 60, names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the campaign runs (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="the mutator's seed (default 0)")
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"where the report goes (default {OUT.relative_to(ROOT)})"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = campaign(args.minutes, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"[fuzz] {report['replies_tried']} replies in {report['rounds']} rounds over {report['minutes']} min: "
        f"{report['escaped']} escaped, {report['non_finite_models']} non-finite models, "
        f"{len(report['problems'])} problems -> {args.out}"
    )
    for problem in report["problems"]:
        print(problem, file=sys.stderr)
    return 0 if not (report["escaped"] or report["non_finite_models"] or report["problems"]) else 1


if __name__ == "__main__":
    sys.exit(main())
