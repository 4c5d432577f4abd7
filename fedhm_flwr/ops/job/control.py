"""``flwr list --run-id`` and ``flwr stop`` answered in the launcher's own process.

The launcher asks the SuperLink for its run's final status at the end of every run, and stops the run on
every Ctrl-C (:class:`~fedhm_flwr.ops.job.flower_job.FlowerJob`). As ``flwr`` commands each ask starts a
Python process that imports Flower's CLI: 1.5-2 s here, paid after the last round, when the user is waiting
for the command to end. :func:`warm` imports the CLI's own parts in a background thread while the run trains
(the launcher only reads ``flwr run``'s output then), and :func:`ask` calls them as the two commands do: the
connection read from ``FLWR_HOME``'s ``config.toml`` (:func:`flwr.cli.flower_config.read_superlink_connection`),
the Control API client the CLI builds (:func:`flwr.cli.utils.init_http_client_from_connection`, with its
interceptors and account authentication), ``ListRuns`` formatted by ``flwr list``'s own JSON writer and
``StopRun``; an error the CLI would print as ``{"success": false, ...}`` comes back as that.

Where that is not possible (the parts did not import: another Flower release moved them), :func:`ask` returns
None and the caller starts the command as before: the answer is the CLI's either way.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

FLWR_HOME = "FLWR_HOME"  # the CLI's home folder (flwr.common.constant.FLWR_HOME; not imported here: the launcher
# imports no Flower module before its run)
_LOCK = threading.Lock()  # one ask at a time: FLWR_HOME is read from this process's environment
_IMPORTING = threading.Lock()  # apart: an ask still stuck on an unanswering SuperLink never holds up warm()
_STATE: dict[str, Any] = {"thread": None, "modules": None}


def _import() -> dict[str, Any] | None:
    """The CLI's parts this module calls (None: one is missing)."""
    try:
        import click
        import flwr.proto.control_pb2 as control_pb2
        from flwr.cli import flower_config, ls, utils

        for owner, name in (
            (flower_config, "read_superlink_connection"),
            (utils, "init_http_client_from_connection"),
            (utils, "flwr_cli_exc_handler"),
            (ls, "_display_one_run"),
            (ls, "_to_json"),
            (control_pb2, "StopRunRequest"),
        ):
            getattr(owner, name)
    except (ImportError, AttributeError):
        return None
    return {"click": click, "flower_config": flower_config, "ls": ls, "utils": utils, "control_pb2": control_pb2}


def _load() -> None:
    _STATE["modules"] = _import() or {}


def warm() -> None:
    """Import the CLI's parts in a background thread (once per process)."""
    with _IMPORTING:
        if _STATE["thread"] is None:
            thread = threading.Thread(target=_load, name="fedhm-control-import", daemon=True)
            _STATE["thread"] = thread
            thread.start()


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's ``FLWR_HOME`` as in ``env`` for the block (the CLI reads it from the environment)."""
    before = os.environ.get(FLWR_HOME)
    if env.get(FLWR_HOME) is None:
        os.environ.pop(FLWR_HOME, None)
    else:
        os.environ[FLWR_HOME] = env[FLWR_HOME]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FLWR_HOME, None)
        else:
            os.environ[FLWR_HOME] = before


def ask(
    env: Mapping[str, str], connection: str, command: str, run_id: int, timeout: float = 60.0
) -> dict[str, Any] | None:
    """What ``flwr <command> ... <connection> --format json`` prints for ``run_id`` (``command``: ``list``
    with ``--run-id``, or ``stop``), parsed; ``{}`` when the SuperLink gives no answer within ``timeout`` s
    (as the command killed then); None when the CLI's parts are not available here (start the command)."""
    answer: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answer.update(value=_ask(env, connection, command, run_id)), name="fedhm-control", daemon=True
    )
    thread.start()
    thread.join(timeout)
    return answer.get("value", {}) if not thread.is_alive() else {}


def _ask(env: Mapping[str, str], connection: str, command: str, run_id: int) -> dict[str, Any] | None:
    warm()
    thread = _STATE["thread"]
    thread.join()
    modules = _STATE["modules"]
    if not modules:
        return None
    click = modules["click"]
    with _LOCK, _environment(env):
        client = None
        try:
            connected = modules["flower_config"].read_superlink_connection(connection)
            with contextlib.redirect_stdout(io.StringIO()):  # its "Using SuperLink: ..." line, for a console
                client = modules["utils"].init_http_client_from_connection(connected)
            if command == "list":
                return dict(json.loads(modules["ls"]._to_json(modules["ls"]._display_one_run(client, run_id))))
            if command == "stop":
                with modules["utils"].flwr_cli_exc_handler():
                    response = client.StopRun(request=modules["control_pb2"].StopRunRequest(run_id=run_id))
                if not response.success:
                    raise click.ClickException(f"Run {run_id} couldn't be stopped.")
                return {"success": True, "run-id": f"{run_id}"}
            raise ValueError(f"unknown command {command!r}")
        except click.ClickException as err:  # what the CLI prints as {"success": false, "error-message": ...}
            return {"success": False, "error-message": err.format_message()}
        except click.exceptions.Exit:
            return {}
        except Exception:  # noqa: BLE001 - anything else (another Flower release): the command itself answers
            return None
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
