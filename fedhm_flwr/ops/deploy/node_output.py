"""What ``fedhm supernode`` (:mod:`fedhm_flwr.ops.deploy.supernode`) reads in a SuperNode's output: one
start's story (:class:`Ended`: connected or not, refused, Flower's own error exit, a crash, its last
line) and the lines it keeps off the console (:class:`Quiet`: the traceback Python prints when Flower
exits from a thread after the SuperNode's goodbye).

Standard library only, as the wrapper that imports it (nothing of the app or of Flower; tests compare
the strings below with Flower's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Flower's values: the code of a refused activation (``ApiErrorCode``), the line of a SuperNode's clean stop,
#: of an error exit, the line it logs once the SuperLink has activated it
ACTIVATION_FAILED = "[code: 2004]"
LEAVING = "SuperNode terminated gracefully"
CONNECTED = "SuperNode ID: "
FLOWER_EXIT = re.compile(r"Exit Code: (\d+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: the last line of a Python traceback: ``FileNotFoundError: [Errno 2] ...``, ``httpx.ConnectError: ...``
EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def plain(raw: bytes) -> str:
    return ANSI.sub("", raw.decode(errors="replace")).rstrip("\r\n")


@dataclass
class Ended:
    """One SuperNode start, as its output (:meth:`read`) and its exit tell it."""

    code: int = 0  # its exit status (negative: killed by that signal)
    seconds: float = 0.0  # how long it ran
    refused: bool = False  # the SuperLink refused its activation (code 2004)
    flower_code: int | None = None  # Flower's own error exit code ("Exit Code: N"), when it printed one
    last_line: str = ""  # its last line of output
    leaving: bool = False  # it said it stops cleanly
    exited: bool = False  # later lines are its children's (as "SuperExec terminated gracefully.")
    afresh: bool = False  # stopped by the wrapper to drop the work of a SuperLink that is gone: start again now
    connected: bool = False  # the SuperLink activated it ("SuperNode ID: ...")
    crash: str = ""  # the exception of a traceback it printed before it connected (its start failed)
    stuck: str = ""  # why the wrapper stopped it for good: it did not connect (see ``fedhm supernode``)
    lines: int = 0  # lines read
    code_line: int = 0  # the number of the last "Exit Code" line
    in_traceback: bool = False

    def read(self, raw: bytes) -> None:
        line = plain(raw).strip()
        self.lines += 1
        self.refused |= ACTIVATION_FAILED in line  # follows Flower's "Exit Code: 305" line
        self.leaving |= LEAVING in line
        self.connected |= CONNECTED in line
        if match := FLOWER_EXIT.search(line):
            self.flower_code, self.code_line = int(match.group(1)), self.lines
        if line.startswith("Traceback (most recent call last)"):
            self.in_traceback = True
        elif self.in_traceback and EXCEPTION.match(line):
            self.in_traceback = False
            if not self.connected and not self.crash:
                self.crash = line[:300]
        self.last_line = line[-300:] if line and not self.exited else self.last_line

    def close(self, code: int, seconds: float) -> Ended:
        """Its exit. Flower's own error exit prints its code, a few lines, and exits with status 1: an
        "Exit Code" line further up was a ClientApp's (they write to the same output)."""
        self.code, self.seconds = code, seconds
        if not (code > 0 and self.lines - self.code_line < 20):
            self.flower_code = None
        return self


def hint(error: str) -> str:
    """What to do about a SuperNode's start error, where it is a known one ('' otherwise)."""
    if "FileNotFoundError" in error and ("flower-superexec" in error or "flwr-" in error):
        return ": Flower starts it by name; put the virtualenv's bin/ on PATH (docs/DEPLOY.md)"
    return ""


class Quiet:
    """The SuperNode's lines as passed through, less the traceback of a clean exit: after its goodbye,
    Flower exits from a signal handler while Python joins its threads, and Python prints ``Exception
    ignored in: <module 'threading' ...>``, a traceback, ``SystemExit: 0``. Such a block is held back
    until its last line: ``SystemExit`` with status 0 drops it (one note instead), anything else passes
    it through whole."""

    def __init__(self) -> None:
        self.held: list[bytes] = []
        self.dropped = 0

    def feed(self, raw: bytes, leaving: bool) -> list[bytes]:
        """What to write of ``raw`` now (``leaving``: the SuperNode said its goodbye)."""
        line = plain(raw)
        if not self.held:
            if leaving and line.startswith("Exception ignored in"):
                self.held = [raw]
                return []
            return [raw]
        self.held.append(raw)
        if line.startswith((" ", "\t", "Traceback", "During handling")) or not line.strip() or len(self.held) > 60:
            return [] if len(self.held) <= 60 else self._flush()
        if re.fullmatch(r"SystemExit: 0?", line.strip()):
            self.held, self.dropped = [], self.dropped + 1
            return []
        return self._flush()

    def _flush(self) -> list[bytes]:
        out, self.held = self.held, []
        return out
