"""Which code made a run: the git commit of the project and whether its code had uncommitted
changes, read when the run starts (``summary.json``'s ``code_commit`` / ``code_dirty``, also in
``status.json``), so that a study can tell runs of different code apart (``bench/results_page.py``
lists them and flags a study whose runs span several). Without git, or outside a git checkout
(an installed package), the commit is ``unknown`` and ``dirty`` is None: never an error."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

#: the project's root (the folder holding ``fedhm_flwr/``)
ROOT = Path(__file__).resolve().parents[2]
#: the folders whose uncommitted changes change what a run computes
CODE_PATHS = ("fedhm_flwr", "strategies", "clients", "conf")
UNKNOWN = "unknown"


def _git(*args: str, cwd: Path) -> str | None:
    """git's stdout, stripped; None when git is absent, fails or takes over 10 s."""
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def code_version(root: Path = ROOT) -> dict[str, Any]:
    """``{"code_commit": short hash or "unknown", "code_dirty": True/False, or None when unknown}``."""
    head = _git("rev-parse", "--short", "HEAD", cwd=root)
    if not head:
        return {"code_commit": UNKNOWN, "code_dirty": None}
    status = _git("status", "--porcelain", "--", *CODE_PATHS, cwd=root)
    return {"code_commit": head, "code_dirty": None if status is None else bool(status)}


def version_label(commit: Any, dirty: Any) -> str:
    """How pages name a code version: ``abc1234``, ``abc1234 (with uncommitted changes)``, ``unknown``."""
    return f"{commit or UNKNOWN}" + (" (with uncommitted changes)" if dirty else "")
