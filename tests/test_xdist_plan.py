"""``make test``'s plan for pytest-xdist's workers (tests/xdist_plan.py): the files that mostly wait run on a
worker of their own, tests/test_devices.py beside tests/test_deploy.py, every worker ends with the queue."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from xdist_plan import TOGETHER, WAITING, WAITING_WORKER, WaitingApart

ROOT = Path(__file__).resolve().parents[1]


class Node:
    """What the scheduler uses of a pytest-xdist worker."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _slow_tests(path: Path) -> list[str]:
    """The test functions of a file marked ``@pytest.mark.slow`` (read from its source)."""
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and any("slow" in ast.unparse(d) for d in node.decorator_list)
    ]


def test_the_planned_files_exist_and_hold_slow_tests():
    for name in (*WAITING, *TOGETHER, *TOGETHER.values()):
        assert _slow_tests(ROOT / name), f"{name}: no slow test (the plan names a file that does not wait)"
    assert set(TOGETHER.values()) <= set(WAITING)


def _schedule(collection: list[str], workers: int) -> tuple[WaitingApart, list[Node]]:
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=SimpleNamespace(loadscopereorder=False))
    sched = WaitingApart(config)  # type: ignore[arg-type]
    nodes = [Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes


def _files(node: Node, collection: list[str]) -> list[str]:
    return [collection[i].split("::")[0] for i in node.sent]


def _finish(sched: WaitingApart, node: Node) -> None:
    """The node runs what it was sent (the scheduler may send it more as it ends)."""
    done = 0
    while done < len(node.sent):
        sched.mark_test_complete(node, node.sent[done])
        done += 1


def test_the_waiting_files_go_to_their_worker_and_the_others_to_the_rest():
    general = [f"tests/test_{name}.py::test_{i}" for name in ("slow_cpu", "a", "b", "c", "d") for i in range(3)]
    waiting = [f"{file}::test_{i}" for file in (*WAITING, *TOGETHER) for i in range(2)]
    collection = general[:3] + waiting + general[3:]  # (slow files first, as tests/conftest.py orders them)
    sched, (gw0, gw1, gw2) = _schedule(collection, 3)
    assert gw0.gateway.id == WAITING_WORKER
    # the waiting worker starts with the first waiting file, test_devices.py's tests with test_deploy.py's
    assert set(_files(gw0, collection)) == {"tests/test_deploy.py", "tests/test_devices.py"}
    first = [f for node in (gw1, gw2) for f in _files(node, collection)]
    assert first and not set(first) & {*WAITING, *TOGETHER}
    assert "tests/test_slow_cpu.py" in first  # collection order: the slow files first
    # the waiting worker takes only waiting files while there are some (in their order), then general ones
    _finish(sched, gw0)
    mine = _files(gw0, collection)
    assert [f for f in dict.fromkeys(mine[: len(waiting)]) if f not in TOGETHER] == list(WAITING)
    assert mine[len(waiting) :] and not set(mine[len(waiting) :]) & {*WAITING, *TOGETHER}
    # the others end the general files, then take what is left: nothing stays queued
    for node in (gw1, gw2, gw0):
        _finish(sched, node)
    ran = sorted(i for node in (gw0, gw1, gw2) for i in node.sent)
    assert ran == list(range(len(collection)))
    assert sched.tests_finished


def test_a_worker_without_its_kind_of_file_takes_the_other_kind():
    waiting = [f"{file}::test_0" for file in WAITING]
    collection = [*waiting, "tests/test_a.py::test_0"]
    sched, (gw0, gw1) = _schedule(collection, 2)
    _finish(sched, gw1)  # its one general file done: it helps with the waiting files
    assert _files(gw1, collection)[0] == "tests/test_a.py"
    assert set(_files(gw1, collection)[1:]) <= set(WAITING) and len(_files(gw1, collection)) > 1
    _finish(sched, gw0)
    assert sorted(gw0.sent + gw1.sent) == list(range(len(collection)))
