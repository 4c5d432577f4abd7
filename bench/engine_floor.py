"""Flower's simulation engine alone: the floor of the scale figure (``bench/scale.py``), written
apart from the project (it imports nothing from ``fedhm_flwr``, ``strategies`` or ``clients``).

    python -m bench.engine_floor --clients 10000 --work-ms 20 [--no-query] [--rounds 5] [--per-round 100]

A bare ServerApp and ClientApp on Flower's Message API, run by ``flwr.simulation.run_simulation``
(the Ray backend, one CPU per client, as the project's simulations) with the messages FedHM's
scale runs send: each round ``--per-round`` TRAIN messages to a uniform sample of the nodes, each
carrying one float32 array of the CNN's size (98,000 values, echoed back), and, unless
``--no-query``, one QUERY message to each node of the next round's sample, pushed right after
the round's training messages and pulled alongside their replies (the answers a round has not
pulled yet are waited for when the next one starts). Replies are pulled from 10 ms, doubling up
to 0.5 s between pulls. The ClientApp answers a query at once and spends ``--work-ms`` of its
thread's CPU time on each training message (busy numpy adds) before echoing the array: nothing else
happens anywhere, so its round times are what the engine itself costs for that traffic.

Prints one line, ``ENGINE_FLOOR {json}``: the clients, work, whether it queried, each round's
seconds (push to the last training reply) and the replies without an error per message type.
:func:`engine_rounds` runs it in a subprocess (Ray starts and stops with it) and returns that dict.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

MARK = "ENGINE_FLOOR "
PAYLOAD_VALUES = 98_000  # the CNN w16's parameter count, in one float32 array


def _apps(clients: int, work_ms: float, query: bool, rounds: int, per_round: int) -> tuple[ServerApp, ClientApp]:
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        end = time.thread_time() + work_ms / 1000
        busy = np.zeros(1000)
        while time.thread_time() < end:
            busy += 1.0
        return Message(
            RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 6})}), reply_to=msg
        )

    @client.query()
    def answer(msg: Message, context: Context) -> Message:
        return Message(
            RecordDict({"info": ConfigRecord({"partition": int(context.node_config["partition-id"])})}), reply_to=msg
        )

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes: list[int] = []
        while len(nodes) < clients:
            nodes = sorted(grid.get_node_ids())
            time.sleep(0.2)
        rng = random.Random(0)
        samples = [rng.sample(nodes, per_round) for _ in range(rounds + 1)]
        payload = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(PAYLOAD_VALUES, np.float32))})})
        ask = RecordDict({"query": ConfigRecord({"node-info": 1})})

        def push(node_ids: list[int], kind: str, content: RecordDict) -> set[str]:
            sent = grid.push_messages([Message(content, dst_node_id=n, message_type=kind) for n in node_ids])
            return {mid for mid in sent if mid}

        def pull(pending: set[str], also: set[str] = frozenset()) -> set[str]:
            """Pull until every ``pending`` reply came; the ``also`` replies along; those still out."""
            pending, also, poll = set(pending), set(also), 0.01
            while pending:
                got = list(grid.pull_messages(list(pending | also)))
                for m in got:
                    if not m.has_error():
                        out["replies"][m.metadata.message_type] = out["replies"].get(m.metadata.message_type, 0) + 1
                came = {m.metadata.reply_to_message_id for m in got}
                pending -= came
                also -= came
                if pending:
                    time.sleep(poll)
                    poll = min(2 * poll, 0.5)
            return also

        out: dict[str, Any] = {
            "clients": clients,
            "work_ms": work_ms,
            "query": query,
            "per_round": per_round,
            "replies": {},
        }  # message type -> replies without an error
        t0 = time.perf_counter()
        if query:  # the start-up asks round 1's sample
            pull(push(samples[0], MessageType.QUERY, ask))
        out["startup_seconds"] = time.perf_counter() - t0
        out["round_seconds"], still_out = [], set()
        for r in range(rounds):
            t0 = time.perf_counter()
            if still_out:
                pull(still_out)
            trains = push(samples[r], MessageType.TRAIN, payload)
            queries = push(samples[r + 1], MessageType.QUERY, ask) if query and r < rounds - 1 else set()
            still_out = pull(trains, queries)
            out["round_seconds"].append(time.perf_counter() - t0)
        print(MARK + json.dumps(out), flush=True)

    return server, client


def engine_rounds(
    clients: int, work_ms: float, query: bool = True, rounds: int = 5, per_round: int = 100, timeout: float = 900.0
) -> dict[str, Any]:
    """One run of this module in a subprocess; its printed dict (RuntimeError when it printed none)."""
    cmd = [
        sys.executable,
        "-m",
        "bench.engine_floor",
        "--clients",
        str(clients),
        "--work-ms",
        str(work_ms),
        "--rounds",
        str(rounds),
        "--per-round",
        str(per_round),
    ] + ([] if query else ["--no-query"])
    proc = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=timeout, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"bench.engine_floor exited {proc.returncode} without a result:\n{proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--work-ms", type=float, default=0.0, help="CPU time a client spends per training message")
    parser.add_argument("--no-query", action="store_true", help="no node-info queries")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=100)
    args = parser.parse_args(argv)
    if not (args.clients >= args.per_round >= 1 and args.rounds >= 1 and args.work_ms >= 0):
        parser.error("need --clients >= --per-round >= 1, --rounds >= 1 and --work-ms >= 0")
    server, client = _apps(args.clients, args.work_ms, not args.no_query, args.rounds, args.per_round)
    run_simulation(
        server,
        client,
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )


if __name__ == "__main__":
    main()
