"""What travels and what the server redoes: the global model serialised once per version, the
wire dtype (``wire.dtype``) both ways, node-info queries only for the sampled nodes
(``availability.query = sampled``). In process, real strategy and client handlers on the LocalGrid."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MessageType

from fedhm_flwr.config import ConfigError, load_config, model_spec, run_options
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy


def _start(cfg):
    return ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, model_spec(cfg)))


def test_the_server_serializes_each_global_model_once_and_never_reads_it_back(toy_cfg, monkeypatch):
    cfg = toy_cfg("rounds=2 evaluation.where=both")  # payloads, server and client evaluation
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    reads = []
    real = ArrayRecord.to_torch_state_dict

    def spy(self, *args, **kwargs):
        if strategy.wire._global_record is not None and self is strategy.wire._global_record:
            reads.append(True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ArrayRecord, "to_torch_state_dict", spy)
    strategy.start(LocalGrid(6, client_handlers()), _start(cfg), num_rounds=2)
    assert len(strategy.history) == 2 and "fed_acc/all" in strategy.history[-1]
    # conv1 and fc are in every level's model as they are in the global one: 3 model versions
    # (initial, after round 1, after round 2), each serialised once for the merged record, every
    # level's payload and the clients' evaluation alike
    for key in ("conv1.weight", "fc.weight", "fc.bias", "bn1.weight"):
        assert strategy.wire.array_cache.serialized[key] == 3, key
    assert reads == []  # the next round and the evaluation take the state itself


def _one_round(cfg):
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid = LocalGrid(6, client_handlers())
    msgs = list(strategy.configure_train(1, _start(cfg), None, grid))
    replies = list(grid.send_and_receive(msgs))
    sent = sum(m.content["arrays"].count_bytes() for m in msgs)
    received = sum(m.content["arrays"].count_bytes() for m in replies)
    params = sum(int(np.prod(a.shape)) for m in msgs for a in m.content["arrays"].values())
    new, _ = strategy.aggregate_train(1, replies)
    assert strategy.round_log.sent_bytes > sent and not strategy.round_log.rejected
    return new.to_torch_state_dict(), sent / params, received / params, replies


def test_float16_and_bfloat16_halve_the_bytes_both_ways_and_aggregate_within_their_rounding(toy_cfg):
    # lr so small that the clients send back what they received: the states differ by rounding only
    base = "model.width=16 train.lr=1e-30"
    ref, sent32, recv32, _ = _one_round(toy_cfg(base))
    assert 4.0 <= sent32 < 4.1 and 4.0 <= recv32 < 4.1  # float32 (+ each array's .npy header)
    for dtype, unit in (("float16", 2.0**-11), ("bfloat16", 2.0**-8)):
        got, sent, recv, replies = _one_round(toy_cfg(f"{base} wire.dtype={dtype}"))
        assert 2.0 <= sent < 2.1 and 2.0 <= recv < 2.1, dtype
        assert all(a.dtype in ("float16", "int16") for m in replies for a in m.content["arrays"].values())
        for key, tensor in ref.items():
            assert got[key].dtype == torch.float32
            err, norm = (float(torch.linalg.vector_norm(t)) for t in (got[key] - tensor, tensor))
            # one rounding each way (a factorized layer: its two factors', recovered as A·B); the
            # absolute term: values below float16's range (the clients' 1e-30 steps) flush to 0
            assert err <= 4 * unit * norm + 1e-6, (dtype, key, err, norm)
        assert any(not torch.equal(got[k], ref[k]) for k in ref)  # it did travel in 16 bits


def test_the_config_check_refuses_other_wire_dtypes_and_query_modes():
    with pytest.raises(ConfigError, match=r"wire\.dtype"):
        load_config("wire.dtype=int8")
    with pytest.raises(ConfigError, match=r"availability\.query"):
        load_config("availability.query=some")


def test_sampled_queries_ask_only_the_round_s_nodes_and_levels_stay_put(toy_cfg):
    def rounds(cfg, count, prefetch=False, startup=False):
        strategy, grid = FedHMStrategy(run_options(cfg), model_spec(cfg)), LocalGrid(20, client_handlers())
        asked_per_round, trained_per_round, before = [], [], 0
        if startup:  # as start() does before round 1: its queries are the start-up's, not the round's
            strategy.discovery.startup(grid, 1)
            asked_per_round.append({n for n, kind in grid.delivered if kind == MessageType.QUERY})
            before = len(grid.delivered)
        for rnd in range(1, count + 1):
            msgs = list(strategy.configure_train(rnd, _start(cfg), None, grid))
            if prefetch and rnd < count:  # as start() does once a round is handed out: next round's new nodes
                strategy.discovery.prefetch(grid, rnd + 1)
            asked_per_round.append({n for n, kind in grid.delivered[before:] if kind == MessageType.QUERY})
            trained_per_round.append({m.metadata.dst_node_id for m in msgs})
            before = len(grid.delivered)
        return strategy, asked_per_round, trained_per_round

    common = "num_clients=20 fraction_train=0.25"
    everyone, asked, _ = rounds(toy_cfg(common), 1)
    assert len(asked[0]) == 20  # query=all: every node when it connects
    sampled, asked, trained = rounds(toy_cfg(f"{common} availability.query=sampled"), 4)
    assert len(trained[0]) == 5 and asked[0] == trained[0]  # only the round's nodes, in round 1
    for rnd in range(1, 4):  # later rounds ask only their nodes not asked before
        assert asked[rnd] == trained[rnd] - set().union(*trained[:rnd])
    assert sampled.nodes  # a node's level is its own, whoever was asked first
    for node_id in sampled.nodes:
        assert sampled.assignment.levels_of[node_id] == everyone.assignment.levels_of[node_id]
    # asked ahead (behind the previous round's training): the same samples, each node asked once,
    # the asking done before the round that trains it
    _, ahead, trained_ahead = rounds(toy_cfg(f"{common} availability.query=sampled"), 4, prefetch=True)
    assert trained_ahead == trained
    assert ahead == [asked[0] | asked[1], asked[2], asked[3], set()]
    # with the start-up before round 1: the same samples; round 1's nodes were asked during the
    # start-up, so round 1 itself asks none (nor, with query=all, any node at all)
    _, ahead, trained_started = rounds(toy_cfg(f"{common} availability.query=sampled"), 4, True, True)
    assert trained_started == trained
    cfg = toy_cfg(f"{common} availability.query=sampled")  # round 1 counts no node the start-up asked
    strategy, grid = FedHMStrategy(run_options(cfg), model_spec(cfg)), LocalGrid(20, client_handlers())
    assert strategy.discovery.startup(grid, 1)["startup_queried"] == 5
    list(strategy.configure_train(1, _start(cfg), None, grid))
    assert strategy.round_log.queried == 0 and strategy.round_log.query_bytes == 0
    assert ahead == [asked[0], asked[1], asked[2], asked[3], set()]  # each round pushes the next one's
    _, asked_all, trained_all = rounds(toy_cfg(common), 2, startup=True)
    assert len(asked_all[0]) == 20 and asked_all[1:] == [set(), set()] and len(trained_all[0]) == 5


def test_exchange_polls_until_every_reply_came_or_the_timeout():
    from flwr.app import Message, RecordDict

    from fedhm_flwr.server.transport import collect, exchange

    LocalGrid(1, {})  # sets the process's task identity, which a new Message needs (as a ServerApp has it)

    class SlowGrid:  # replies show up after a few pulls, like a SuperLink's (never from ``silent`` nodes)
        def __init__(self, pulls_needed, silent=()):
            self.pulls, self.needed, self.sent, self.silent = 0, pulls_needed, {}, set(silent)

        def push_messages(self, messages):
            for i, msg in enumerate(messages):
                msg.metadata.__dict__["_message_id"] = f"m{i}"
                self.sent[f"m{i}"] = msg
            return list(self.sent)

        def pull_messages(self, ids):
            self.pulls += 1
            if self.pulls < self.needed:
                return []
            return [
                Message(RecordDict(), reply_to=self.sent[i])
                for i in ids
                if self.sent[i].metadata.dst_node_id not in self.silent
            ]

    msgs = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in (1, 2, 3)]
    grid = SlowGrid(4)
    assert len(exchange(grid, msgs, timeout=5.0)) == 3 and grid.pulls == 4
    msgs = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in (1, 2, 3)]
    grid = SlowGrid(10**9)
    assert exchange(grid, msgs, timeout=0.2) == [] and grid.pulls >= 2  # gave up at the timeout
    # the replies to ``also`` come along when they are there, and are not waited for
    for silent, expected in (((), 3), ((3,), 2)):
        msgs = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in (1, 2, 3)]
        grid = SlowGrid(2, silent)
        ids = grid.push_messages(msgs)
        got = collect(grid, ids[:1], timeout=5.0, also=ids[1:])
        assert sorted(m.metadata.reply_to_message_id for m in got) == ids[:expected] and grid.pulls == 2


def test_no_exchange_waits_on_flower_s_three_second_poll():
    """``Grid.send_and_receive`` sleeps 3 s between pulls; the package exchanges through
    :func:`fedhm_flwr.server.transport.exchange` (the in-process LocalGrid implements it)."""
    calls = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "fedhm_flwr").rglob("*.py")
        if path.name != "local_grid.py" and ".send_and_receive(" in path.read_text()
    ]
    assert calls == []


# --------------------------------------------------------------------------- every record key from protocol

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "fedhm_flwr" / "core" / "protocol.py"
#: where a record key must be protocol's constant (protocol.py itself spells them)
KEYED_SOURCES = ("fedhm_flwr", "bench", "scripts")
#: written apart from the project on purpose (it imports nothing from it: tests/test_bench_floors.py),
#: so it spells its own keys: Flower's engine alone, the scale figure's floor
APART = {ROOT / "bench" / "engine_floor.py"}
#: what holds records or record keys: a message's ``content`` (and its records), a node's
#: ``node_config``, and the records built by these constructors (or names bound to any of them)
RECORD_ATTRIBUTES = {"content", "node_config"}
RECORD_TYPES = {"RecordDict", "ConfigRecord", "MetricRecord", "Context"}
_KEY = re.compile(r"[a-z]+(-[a-z]+)*-?")


def protocol_keys() -> set[str]:
    """The values of protocol's module-level string constants that are record names or keys
    (lower-case words joined by hyphens; a trailing hyphen: a prefix such as ``capability-``)."""
    out = set()
    for node in ast.parse(PROTOCOL.read_text()).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        names = target.elts if isinstance(target, ast.Tuple) else [target]
        values = value.elts if isinstance(value, ast.Tuple) else [value]
        for name, v in zip(names, values):
            if (
                isinstance(name, ast.Name)
                and name.id.isupper()
                and isinstance(v, ast.Constant)
                and isinstance(v.value, str)
                and _KEY.fullmatch(v.value)
            ):
                out.add(v.value)
    return out


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    nodes = ast.walk(annotation) if annotation is not None else ()
    return {n.id if isinstance(n, ast.Name) else n.attr for n in nodes if isinstance(n, (ast.Name, ast.Attribute))}


def _constructor(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and (
        getattr(node.func, "id", None) in RECORD_TYPES or getattr(node.func, "attr", None) in RECORD_TYPES
    )


class _KeyScan(ast.NodeVisitor):
    """Literal record keys of one module: a protocol key spelled as a subscript, a ``.get``/``.pop``/
    ``.setdefault`` argument, an ``in`` test or a dict literal's key. A hyphenated key counts
    anywhere (no other dict in the project has such keys); a one-word key ("level", "seed") only
    where it keys a record (other dicts, e.g. metric rows and data specs, use the same words)."""

    def __init__(self, keys: set[str]):
        self.keys = keys
        self.prefixes = tuple(k for k in keys if k.endswith("-"))
        self.scopes: list[set[str]] = [set()]  # names bound to records, per function
        self.found: list[tuple[int, str]] = []

    def _record(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in RECORD_ATTRIBUTES or self._record(node.value)
        if isinstance(node, ast.Subscript):
            return self._record(node.value)
        if isinstance(node, ast.Name):
            return node.id in self.scopes[-1]
        return _constructor(node)

    def _key(self, key: ast.expr | None, holder: ast.expr | None) -> None:
        if isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
            if str(key.values[0].value).startswith(self.prefixes):
                self.found.append((key.lineno, f"f-string {key.values[0].value!r}..."))
            return
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value in self.keys):
            return
        if "-" in key.value or (holder is not None and self._record(holder)):
            self.found.append((key.lineno, key.value))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.scopes.append({a.arg for a in args if _annotation_names(a.annotation) & RECORD_TYPES})
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._record(node.value):
            self.scopes[-1].update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._key(node.slice, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault") and node.args:
            self._key(node.args[0], node.func.value)
        if _constructor(node):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Dict):
                    for key in arg.keys:
                        self._key(key, node)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            self._key(node.left, node.comparators[0])
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key in node.keys:  # a one-word key only in a record constructor's dict (visit_Call)
            if isinstance(key, ast.JoinedStr) or (isinstance(key, ast.Constant) and "-" in str(key.value)):
                self._key(key, None)
        self.generic_visit(node)


def literal_record_keys(source: str, keys: set[str]) -> list[tuple[int, str]]:
    scan = _KeyScan(keys)
    scan.visit(ast.parse(source))
    return sorted(set(scan.found))


def _keyed_files() -> list[Path]:
    return [
        p for folder in KEYED_SOURCES for p in sorted((ROOT / folder).rglob("*.py")) if p != PROTOCOL and p not in APART
    ]


def test_every_record_key_comes_from_protocol():
    """No module but protocol spells a record name or key: each uses protocol's constant, so a key
    is written once (``fedhm_flwr/core/protocol.py``)."""
    keys = protocol_keys()
    assert {"arrays", "config", "metrics", "level", "num-examples", "partition-id", "capability-"} <= keys
    found = {
        f"{p.relative_to(ROOT)}:{line}: {key}"
        for p in _keyed_files()
        for line, key in literal_record_keys(p.read_text(), keys)
    }
    assert sorted(found) == [], "use fedhm_flwr.core.protocol's constant for these keys"


@pytest.mark.parametrize(
    "snippet",
    [
        'x = msg.content["arrays"]',
        'level = float(msg.content[CONFIG]["level"])',
        'n = metrics.get("num-examples")',
        'r = RecordDict({"metrics": MetricRecord({"seconds": 1.0})})',
        'def f(config: ConfigRecord):\n    return config["seed"]',
        'def f(context):\n    node = context.node_config\n    return "data-dir" in node',
        'config = {"partition-id": 0}',
        'cap = {f"capability-{kind}": 1.0}',
    ],
)
def test_the_key_check_sees_a_literal_key(snippet):
    assert literal_record_keys(snippet, protocol_keys()) != []


def test_the_key_check_sees_a_key_planted_in_a_project_module():
    """bench/server.py reads a task config's level by protocol's constant; spelled out, it is refused."""
    source = (ROOT / "bench" / "server.py").read_text()
    planted = source.replace("msg.content[CONFIG][LEVEL]", 'msg.content[CONFIG]["level"]')
    line = next(i for i, text in enumerate(planted.splitlines(), 1) if '["level"]' in text)
    assert planted != source and literal_record_keys(source, protocol_keys()) == []
    assert literal_record_keys(planted, protocol_keys()) == [(line, "level")]


@pytest.mark.parametrize(
    "snippet",
    [
        'row["seed"] = 1',  # a metric row's column, not a record key
        'spec.get("level")',
        'card = {"config": text, "method": name}',
        'parser.add_argument("--data-dir")',
        'print("num-examples")',
    ],
)
def test_the_key_check_leaves_other_strings(snippet):
    assert literal_record_keys(snippet, protocol_keys()) == []
