"""Which code made a run: the git commit of the project and whether its code had uncommitted
changes, read when the run starts (``summary.json``'s ``code_commit`` / ``code_dirty``, also in
``status.json``), so that a study can tell runs of different code apart (``bench/results_page.py``
lists them and flags a study whose runs span several). Without git, or outside a git checkout
(an installed package), the commit is ``unknown`` and ``dirty`` is None: never an error.

A ServerApp runs from Flower's installed copy of the app bundle, outside any checkout: the app is
staged from the clone (``fedhm run``, ``fedhm deploy-local``, ``fedhm stage``), and staging writes the
clone's version into the bundle's run config (:func:`stamp_app`, the keys :data:`COMMIT_KEY` and
:data:`DIRTY_KEY` of ``[tool.flwr.app.config]``), which the ServerApp records (:func:`recorded_version`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

#: the project's root (the folder holding ``fedhm_flwr/``)
ROOT = Path(__file__).resolve().parents[2]
#: the folders whose uncommitted changes change what a run computes
CODE_PATHS = ("fedhm_flwr", "strategies", "clients", "conf")
UNKNOWN = "unknown"
#: the run-config keys (``[tool.flwr.app.config]``) holding the version the app was staged from
#: (empty in the clone's own ``pyproject.toml``: the ServerApp then asks git)
COMMIT_KEY, DIRTY_KEY = "code-commit", "code-dirty"


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


def stamp_app(pyproject: Path, version: dict[str, Any]) -> None:
    """Write ``version`` (:func:`code_version` of the source the app was staged from) into a staged
    app's ``pyproject.toml`` run config, replacing the empty :data:`COMMIT_KEY` / :data:`DIRTY_KEY`."""
    dirty = version["code_dirty"]
    values = {COMMIT_KEY: str(version["code_commit"]), DIRTY_KEY: "" if dirty is None else str(bool(dirty)).lower()}
    text = pyproject.read_text()
    for key, value in values.items():
        text, found = re.subn(rf'(?m)^{re.escape(key)} = ".*"$', f'{key} = "{value}"', text)
        if found != 1:
            raise ValueError(f'{pyproject}: [tool.flwr.app.config] holds no line {key} = ""')
    pyproject.write_text(text)


def recorded_version(run_config: dict[str, Any]) -> dict[str, Any]:
    """The version a run records: the one its app was staged with (:func:`stamp_app`), else git's of
    the running code (:func:`code_version`)."""
    commit = str(run_config.get(COMMIT_KEY, "") or "")
    if not commit:
        return code_version()
    dirty = str(run_config.get(DIRTY_KEY, "") or "")
    return {"code_commit": commit, "code_dirty": {"true": True, "false": False}.get(dirty)}


def version_label(commit: Any, dirty: Any) -> str:
    """How pages name a code version: ``abc1234``, ``abc1234 (with uncommitted changes)``, ``unknown``."""
    return f"{commit or UNKNOWN}" + (" (with uncommitted changes)" if dirty else "")
