"""How ``make test`` spreads the test files over pytest-xdist's workers (``--dist loadfile``, made here
by tests/conftest.py's ``pytest_xdist_make_scheduler``).

The suite is CPU-bound on a small machine, but a few end-to-end files mostly wait: Flower's heartbeat
window (30-60 s after a node is lost), a deadline, a run's start-up. A worker that waits in one of them
leaves a core idle. ``make test`` therefore runs one worker more than the CPU work needs, and this plan
gives that worker (the first, ``gw0``) the waiting files, one after another, while the other workers run
the rest. A worker that finds its kind of file used up takes the other kind, so every worker ends with
the queue.

It is loadfile in all else: every test of a file runs on one worker (module fixtures are made once), with
one exception: ``TOGETHER`` files share a worker with another file, because a test there starts in the
background beside a test of the other file (tests/conftest.py's ``devices_deployment``)."""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

#: files whose tests mostly wait (Flower's heartbeat window, deadlines, several start-ups of a run), the
#: longest first: on the waiting worker
WAITING = (
    "tests/test_deploy.py",  # the TLS deployment (a SuperLink stopped, a heartbeat window) + tests/test_devices.py
    "tests/test_lifecycle.py",  # a run started four times, 3 s sleeps per round, a sweep's jobs
    "tests/test_hostile_device.py",  # a silent device costs a round its deadline
    "tests/test_killed_supernode.py",  # a killed node's heartbeat window
    "tests/test_supernode_flower.py",  # a node's SuperLink stopped and started again
)
#: a file whose tests run on the worker of another file's: test_devices.py's deployment starts in the
#: background when test_deploy.py's TLS test starts (both wait on heartbeat windows, side by side)
TOGETHER = {"tests/test_devices.py": "tests/test_deploy.py"}
WAITING_WORKER = "gw0"


class WaitingApart(LoadFileScheduling):
    """``--dist loadfile`` with the waiting files on their own worker (see the module docstring)."""

    def _split_scope(self, nodeid: str) -> str:
        file = super()._split_scope(nodeid)
        return TOGETHER.get(file, file)

    def _assign_work_unit(self, node: Any) -> None:
        """The next file of the node's kind (waiting or not) in collection order, else the next file."""
        assert self.workqueue
        waits = node.gateway.id == WAITING_WORKER and len(self.nodes) > 1
        scope = next((s for s in self.workqueue if (s in WAITING) == waits), next(iter(self.workqueue)))
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])


class PlanHooks:
    """The plan's pytest-xdist hooks (registered by tests/conftest.py where pytest-xdist is loaded)."""

    @pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own (the first answer is taken)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> WaitingApart | None:
        return WaitingApart(config, log) if config.getvalue("dist") == "loadfile" else None

    def pytest_configure_node(self, node: Any) -> None:
        """Tells each worker whether the plan is on (tests/conftest.py's ``devices_deployment``)."""
        node.workerinput["waiting_apart"] = node.config.getvalue("dist") == "loadfile"
