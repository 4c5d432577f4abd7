"""Shared fixtures: small configurations, the in-process grid, and the slow deployment that runs in
the background (``devices_deployment``)."""

from __future__ import annotations

import os
import resource
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from fedhm_flwr.config import load_config  # (imports no torch: the setting below comes first)

# OpenMP's threads sleep as soon as a parallel region ends (they spin for a while by default). The suite runs
# two workers, each with torch's threads, and the processes of real jobs beside them, on as many cores: a
# spinning thread takes a core another process needs. Two copies of tests/test_batched_evaluation.py side by
# side took 50 s with spinning threads, 20 s without; what is computed is the same. Set before torch is
# imported (libgomp reads it once), and inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOY = (
    "num_clients=6 fraction_train=1.0 dataset.max_train_examples=1200 dataset.max_test_examples=300 "
    "model.width=4 train.batch_size=64 evaluation.batch_size=300"
)


@pytest.fixture
def toy_cfg():
    """A seconds-long FedHM configuration (tiny CNN, 1.2k training images, 6 clients)."""

    def make(extra: str = ""):
        return load_config(f"{TOY} {extra}")

    return make


@pytest.fixture
def no_env_data_dir(monkeypatch):
    """No ``$FEDHM_DATA_DIR`` from the caller's shell: the data tests see only the folders they name
    (tests/test_shards.py and tests/test_node_data.py use it for every test)."""
    from fedhm_flwr.data import DATA_DIR_ENV

    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


@pytest.fixture
def ctrl_c_reaches_children():
    """Processes the test starts take Ctrl-C (SIGINT) as a terminal's foreground job does, also where
    pytest itself ignores SIGINT (started with ``&`` from a script: children inherit the ignored
    signal). tests/test_deploy.py's Ctrl-C to ``flwr run`` is otherwise lost, and its log stream
    ends only when the SuperLink gives up on it, about a minute later."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets a handler to the default
    yield
    signal.signal(signal.SIGINT, previous)


class Background:
    """``target(*args, stop=<event>)`` in a daemon thread from :meth:`start` on; :meth:`result` waits for it."""

    def __init__(self, target: Callable[..., Any], *args: Any) -> None:
        self.target, self.args = target, args
        self.stop = threading.Event()  # set: the target gives up at its next wait (and cleans up)
        self.thread: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}

    def start(self) -> None:
        """Start the target (once)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.target.__name__, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self._outcome["value"] = self.target(*self.args, stop=self.stop)
        except BaseException as err:  # noqa: BLE001  raised again by result(), in the test that asks
            self._outcome["error"] = err

    def result(self, timeout: float) -> Any:
        """The target's return value (started now if it was not); what it raised is raised here."""
        self.start()
        assert self.thread is not None
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"{self.thread.name} still running after {timeout:g} s")
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


#: a test's CPU seconds, from the start of its setup (fixtures included) to its teardown's report
_CPU_START = pytest.StashKey[float]()


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="list the N tests that used the most CPU time, setup included (the test process's own and its "
        "reaped child processes': not the daemons a child leaves behind, such as Ray's); 0: none",
    )


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _CPU_START in item.stash:  # (sent to pytest-xdist's controller with it)
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_CPU_START]))


@pytest.hookimpl(tryfirst=True)  # before pytest's own --durations list, which ends the output
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """``--cpu-durations``: the suite is CPU-bound on a small machine (``make test``'s workers share its
    cores), so the tests that use the most CPU matter as much as the slowest."""
    shown = config.getoption("--cpu-durations")
    if not shown:
        return
    used = sorted(
        (
            (value, report.nodeid)
            for reports in terminalreporter.stats.values()
            for report in reports
            if getattr(report, "when", None) == "teardown"
            for key, value in getattr(report, "user_properties", ())
            if key == "cpu_seconds"
        ),
        reverse=True,
    )
    terminalreporter.write_sep("=", f"most CPU {shown} (the test process and its reaped children)")
    for seconds, nodeid in used[:shown]:
        terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")
    terminalreporter.write_line(f"{sum(s for s, _ in used) / 60:.1f} CPU-minutes over {len(used)} tests")


@pytest.fixture(scope="session")
def devices_deployment(request, tmp_path_factory):
    """tests/test_devices.py's deployment (``run_deployment``), started in a background thread by the
    first test that asks for it, when the test of tests/test_devices.py is selected (else None). It
    mostly waits on Flower's heartbeat window: tests/test_deploy.py's TLS deployment, which waits on
    one of its own, asks for it, so that the two run side by side (and the tests after the TLS test
    run while it ends); the test of tests/test_devices.py waits for its result. At the end of the
    session it is stopped if still running (its test was not reached). Under pytest-xdist (``make test``
    runs two workers) it starts when its own test asks for its result."""
    ours = [item for item in request.session.items if item.path.name == "test_devices.py"]
    if ours:
        from test_devices import DEVICES_TEST, run_deployment  # the test module holds the deployment

        ours = [item for item in ours if item.name == DEVICES_TEST]
    if not ours:
        yield None
        return
    background = Background(run_deployment, tmp_path_factory.mktemp("devices"))
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process runs every test: start it now, beside the TLS test
        background.start()
    # (under pytest-xdist another worker may run tests/test_devices.py: its test starts it, beside the other
    # workers' tests, and a worker that never reaches it never starts it)
    yield background
    if background.thread is not None:
        background.stop.set()
        background.thread.join(timeout=120)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: two workers, a file at a time), the files holding slow end-to-end
    tests go first, in their order: they mostly wait (Flower's start-up, heartbeats, deadlines), and the
    other files' tests fill the workers beside them instead of one slow file ending the session alone."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # (stable: the order within each group is kept)
