"""Whether the SuperLink a SuperNode talks to is still there: ``fedhm supernode``
(:mod:`fedhm_flwr.ops.deploy.supernode`) probes its port while ClientApps run (:func:`probe`), and
:class:`LinkWatch` says, from a series of probes, when the SuperLink's runs are over.

Standard library only, as the wrapper that imports it (nothing of the app or of Flower).
"""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import dataclass

#: Flower's values (tests compare them): how long the SuperLink keeps a node that sent no goodbye online
#: (``HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL``), ``flower-supernode --superlink``'s default
HEARTBEAT_WINDOW = 60.0
DEFAULT_SUPERLINK = "127.0.0.1:8000"
REFUSED_PATIENCE = 10.0  # a SuperLink port that refuses connections this long: the SuperLink is down
PROBE_EVERY = (10.0, 2.0)  # seconds between probes of the SuperLink while it answers / once it did not


def superlink_address(args: list[str]) -> tuple[str, int] | None:
    """(host, port) of ``--superlink HOST:PORT`` in ``flower-supernode`` arguments (``[v6]:port`` too)."""
    value = DEFAULT_SUPERLINK
    for i, arg in enumerate(args):
        if arg.startswith("--superlink="):
            value = arg.split("=", 1)[1]
        elif arg == "--superlink" and i + 1 < len(args):
            value = args[i + 1]
    host, _, port = value.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def probe(address: tuple[str, int], timeout: float = 5.0) -> str:
    """``up`` (a TCP connection), ``refused`` (nothing listens: the SuperLink is down) or ``unreachable``."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return "up"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"


def behind_proxy(host: str) -> bool:
    """An HTTPS proxy is set for ``host``: the SuperNode (httpx) goes through it, a direct probe would not."""
    return bool(urllib.request.getproxies().get("https")) and not urllib.request.proxy_bypass(host)


@dataclass
class LinkWatch:
    """Since when the SuperLink has been down, from a series of probes."""

    refused_patience: float = REFUSED_PATIENCE
    unreachable_patience: float = HEARTBEAT_WINDOW
    down_since: float | None = None
    refused_since: float | None = None

    def note(self, state: str, now: float) -> str | None:
        """Record one probe (:func:`probe`'s answer at ``now``); why the SuperLink's runs are over, or None."""
        if state == "up":
            self.down_since = self.refused_since = None
            return None
        self.down_since = now if self.down_since is None else self.down_since
        self.refused_since = (now if self.refused_since is None else self.refused_since) if state == "refused" else None
        if self.refused_since is not None and now - self.refused_since >= self.refused_patience:
            return f"has refused connections for {now - self.refused_since:.0f} s (the SuperLink is down)"
        if now - self.down_since >= self.unreachable_patience:
            return (
                f"has not answered for {now - self.down_since:.0f} s (it has marked this node offline and "
                "answered its messages `node unavailable`)"
            )
        return None
