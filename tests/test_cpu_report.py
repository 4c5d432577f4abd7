"""``make test``'s CPU report (``--cpu-durations``, tests/conftest.py): the tests that used the most CPU, a
test's child processes included, ranked by CPU and not by wall time (a test that waits uses none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

BURN = """
import subprocess, sys, time

SPIN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.5: pass"

def test_a_child_burns():
    subprocess.run([sys.executable, "-c", SPIN], check=True)

def test_waits():
    time.sleep(2.0)
"""


def test_the_cpu_report_ranks_tests_by_the_cpu_they_and_their_children_used(tmp_path):
    (tmp_path / "test_burn.py").write_text(BURN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "--cpu-durations=2"]
    proc = subprocess.run(
        [*command, "test_burn.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "most CPU 2" in line)
    first, second, total = lines[start + 1 : start + 4]
    seconds, nodeid = first.split()[0], first.split()[-1]
    assert nodeid == "test_burn.py::test_a_child_burns" and float(seconds.rstrip("s")) >= 1.4  # the child's CPU
    assert second.split()[-1] == "test_burn.py::test_waits" and float(second.split()[0].rstrip("s")) < 0.5
    assert total.endswith("CPU-minutes over 2 tests")
