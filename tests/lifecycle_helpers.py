"""What the lifecycle tests share (tests/test_lifecycle.py, tests/test_lifecycle_parts.py): the
repository root, ``fedhm status``, and the process scans on /proc, written independently of
``fedhm_flwr.ops.job.procs``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fedhm_status(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedhm_flwr", "status", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def process_state(pid: int) -> str | None:
    """One-letter state of a process, None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def program(pid: int) -> str:
    """The program a process runs (``flwr-clientapp`` also for ``python .../flwr-clientapp ...``); '' when gone."""
    try:
        argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return ""
    names = [Path(a.decode(errors="replace")).name for a in argv[:2]]
    return names[1] if len(names) == 2 and names[0].startswith("python") else (names[0] if names else "")


def supernode_starts(needle: str) -> dict[str, dict[int, str]]:
    """Live processes whose environment mentions ``needle`` (e.g. a deployment's folder), grouped by the
    ``fedhm supernode`` start they belong to (the value of ``FEDHM_SUPERNODE_TAG`` the wrapper gives a
    SuperNode and all it starts): {tag: {pid: program}}."""
    starts: dict[str, dict[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not is_alive(int(entry.name)):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        tags = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"FEDHM_SUPERNODE_TAG=")]
        if tags and any(needle.encode() in v for v in environ):
            starts.setdefault(tags[0], {})[int(entry.name)] = program(int(entry.name))
    return starts
