"""Figure 5: many simulated clients through ``flwr run`` (round times, node queries, start-up,
peak memory of the process tree) and the server's per-node state.

The 1000-client runs are part of every ``make bench``. ``--scale-clients N`` adds an N-client run
(100 per round) and the per-node state at three node counts; that run takes long, so its figure is
also written to ``bench/scale/scale-N.json`` (kept in the repository) and every later report
shows the newest such file, with the machine, date and command that produced it. The figure's section of
the report is written by :mod:`bench.scale_report`."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import echo, identity_query
from bench.engine_floor import engine_rounds
from bench.scale_report import middle_rounds, saved_markdown
from fedhm_flwr.config import load_config, model_spec, run_options

#: where ``--scale-clients`` keeps its figure (tracked, unlike bench/reports)
SCALE_DIR = Path(__file__).resolve().parent / "scale"

#: training examples per client in the large run and its reference (Fashion-MNIST's 60,000 / 10,000)
LARGE_EXAMPLES_PER_CLIENT = 6
#: rounds of the large run and its reference: round 2 (the goal's) and, less at the mercy of one
#: noisy round on a shared machine, the median of the rounds between the first (first contact) and
#: the last (final evaluation and deployment statistics)
LARGE_ROUNDS = 5
#: the engine floor's client CPU time per training message at its two calibration runs (ms)
ENGINE_PROBES_MS = (0.0, 30.0)


class TreeMemory:
    """Samples the resident memory of this process and all its descendants (Linux /proc)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                    kids.setdefault(ppid, []).append(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
        return kids

    def _rss(self) -> int:
        kids, total, todo = self._children(), 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                with open(f"/proc/{pid}/status") as fh:
                    for line in fh:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def __enter__(self) -> TreeMemory:
        def loop() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._rss())
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def job_overrides(clients: int, per_round: int, rounds: int, query: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The scale runs' job: ``clients`` nodes, ``per_round`` sampled per round, the global model
    evaluated on 2000 test examples, ``availability.query`` = ``query``, then ``extra``."""
    return [
        f"num_clients={clients}",
        f"fraction_train={per_round / clients}",
        f"rounds={rounds}",
        "evaluation.levels=false",
        "dataset.max_test_examples=2000",
        f"availability.query={query}",
        *extra,
    ]


def large_settings(clients: int) -> tuple[str, ...]:
    """The large run's and its reference's like-for-like settings: the same examples per client at
    every size, split IID (a Dirichlet split of Fashion-MNIST's 60,000 images cannot give 10,000
    clients two examples each)."""
    return ("partition.scheme=iid", f"dataset.max_train_examples={LARGE_EXAMPLES_PER_CLIENT * clients}")


def scale_run(clients: int, per_round: int, rounds: int, query: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``flwr run`` of ``clients`` simulated clients, ``per_round`` sampled per round, with
    ``availability.query`` = ``query`` (and the ``extra`` overrides): per-round times and the ratios
    measured in that run."""
    from fedhm_flwr.ops.job.launch import run_job

    overrides = job_overrides(clients, per_round, rounds, query, extra)
    with tempfile.TemporaryDirectory() as tmp, TreeMemory() as mem:
        t0 = time.perf_counter()
        summary = run_job(overrides, Path(tmp) / "run", quiet=True)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rows]
    queries = [r.get("query_seconds", 0.0) for r in rows]
    servers = [r["server_seconds"] for r in rows]
    asked = [r.get("queried", 0) for r in rows]
    # blocking query time per asked node in the rounds that asked any (warm workers; with
    # ``sampled`` mostly asked ahead, during the previous round's evaluation)
    later = [(q, n) for q, n in zip(queries, asked) if n]
    per_node = sum(q for q, _ in later) / sum(n for _, n in later) if later else None
    return {
        "query": query,
        "round_seconds": seconds,
        "server_seconds": servers,
        "query_seconds": queries,
        "replies": [r["replies"] for r in rows],
        "bytes_queries": [r.get("bytes_queries", 0) for r in rows],
        "queried": asked,
        "query_seconds_per_node": per_node,
        # the start-up before round 1 (NodeDiscovery.startup): the simulation's workers start on
        # their first message (importing torch and the ClientApp) and the nodes find their data
        "startup_seconds": summary.get("startup_seconds"),
        "startup_queried": summary.get("startup_queried"),
        "round1_over_round2": seconds[0] / seconds[1] if len(seconds) > 1 else None,
        "query_share": [q / s for q, s in zip(queries, seconds)],
        "max_query_share": max(q / s for q, s in zip(queries, seconds)),
        "server_share": [v / s for v, s in zip(servers, seconds)],
        "job_wall_seconds": wall,
        "peak_rss_bytes_process_tree": mem.peak,
        "final_acc": summary.get("final_acc/global"),
    }


def server_state_per_node(counts: tuple[int, ...], per_round: int = 100, rounds: int = 2) -> dict[str, Any]:
    """The server's per-node state (node registry, caches: what ``fedhm_flwr/server/`` allocates and keeps)
    after the start-up and ``rounds`` rounds of ``per_round`` echoing clients (CNN, in process), for
    each node count: traced bytes kept (tracemalloc, allocations made in ``fedhm_flwr/server/``), per node."""
    import gc
    import tracemalloc

    from flwr.app import ArrayRecord, MessageType

    from fedhm_flwr.ops.apps.local_grid import LocalGrid
    from fedhm_flwr.ops.apps.server_app import initial_state
    from fedhm_flwr.server.registry import STRATEGIES

    rows = {}
    for n in (counts[0], *counts):  # the first one warms up (imports, one-time caches) and is not kept
        cfg = load_config([f"num_clients={n}", f"fraction_train={per_round / n}", "availability.query=all"])
        spec = model_spec(cfg)
        grid = LocalGrid(n, {MessageType.TRAIN: echo, MessageType.QUERY: identity_query})
        arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, spec))
        gc.collect()
        tracemalloc.start()
        strategy = STRATEGIES["fedhm"](run_options(cfg), spec)
        t0 = time.perf_counter()
        strategy.discovery.startup(grid, 1)
        startup = time.perf_counter() - t0
        for r in range(1, rounds + 1):
            replies = grid.send_and_receive(list(strategy.configure_train(r, arrays, None, grid)))
            arrays, _ = strategy.aggregate_train(r, replies)
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/fedhm_flwr/server/*")])
        tracemalloc.stop()
        kept = sum(stat.size for stat in snapshot.statistics("filename"))
        rows[str(n)] = {
            "nodes": n,
            "known": len(strategy.known.nodes),
            "server_state_bytes": kept,
            "bytes_per_known_node": kept / max(1, len(strategy.known.nodes)),
            "startup_seconds": startup,
        }
        del strategy, grid
    base, top = rows[str(counts[0])], rows[str(counts[-1])]
    slope = (top["server_state_bytes"] - base["server_state_bytes"]) / max(1, counts[-1] - counts[0])
    return {
        "per_round": per_round,
        "rounds": rounds,
        "rows": rows,
        "bytes_per_node": slope,
        "note": "allocations made in fedhm_flwr/server/ and still held (tracemalloc), CNN, echoing clients, "
        "availability.query=all: every node known",
    }


def project_alone(sizes: tuple[int, ...], per_round: int = 100, rounds: int = 3) -> dict[str, Any]:
    """The project without Flower's engine: the same job as the large run and its reference (IID,
    :data:`LARGE_EXAMPLES_PER_CLIENT` examples per client, ``availability.query=sampled``), in
    process (``LocalGrid``: the project's ClientApp handlers called node by node, no SuperLink, no
    Ray), at each node count; its rounds hold the project's own work per round (server, clients,
    evaluation), so their ratio says whether that work grows with the number of nodes."""
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run

    rows = {}
    for n in sizes:
        cfg = load_config(
            job_overrides(n, per_round, rounds, "sampled", (*large_settings(n), "evaluation.deploy_stats=false"))
        )
        with tempfile.TemporaryDirectory() as tmp:
            run(LocalGrid(n, client_handlers()), cfg, Path(tmp))
            lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        done = [json.loads(line) for line in lines]
        rows[str(n)] = {
            "round_seconds": [r["seconds"] for r in done],
            "server_seconds": [r["server_seconds"] for r in done],
        }
    small, large = rows[str(sizes[0])], rows[str(sizes[-1])]
    return {
        "sizes": list(sizes),
        "per_round": per_round,
        "rows": rows,
        "later_rounds_ratio": statistics.median(large["round_seconds"][1:])
        / statistics.median(small["round_seconds"][1:]),
    }


def figure_scale(quick: bool, scale_clients: int | None = None) -> dict[str, Any]:
    """1000 clients, 100 per round (``--quick``: 200, 20): round 1 ÷ round 2, query time ÷ round
    time, server time ÷ round time and peak memory, each measured in the same run; with
    ``availability.query=sampled`` (a round asks only its own new nodes), and, outside ``--quick``,
    with ``all`` (every node asked when it connects) for comparison. With ``scale_clients`` N
    (``--scale-clients``): the ``sampled`` runs only, and N clients, 100 per round (``sampled``), its
    round 2 against a 1000-client reference run with the same examples per client, both split IID,
    and the server's per-node state at 1000, N/2 and N nodes (:func:`server_state_per_node`), saved
    to ``bench/scale/scale-N.json``. Without it, the newest saved figure is attached as ``large_saved``."""
    clients, per_round, rounds = (200, 20, 2) if quick else (1000, 100, 3)
    queries = ("sampled",) if quick or scale_clients else ("sampled", "all")
    runs = {query: scale_run(clients, per_round, rounds, query) for query in queries}
    out: dict[str, Any] = {
        "clients": clients,
        "per_round": per_round,
        "rounds": rounds,
        "runs": runs,
        "goal": "round 1 <= 1.5 x round 2; query time <= 5 % of every round; peak memory < 8 GiB",
        "project_alone": project_alone((clients, scale_clients or 10 * clients), per_round),
    }
    if scale_clients:
        ref = scale_run(clients, per_round, LARGE_ROUNDS, "sampled", large_settings(clients))
        big = scale_run(scale_clients, per_round, LARGE_ROUNDS, "sampled", large_settings(scale_clients))
        big["round2_over_small_round2"] = big["round_seconds"][1] / ref["round_seconds"][1]
        big["middle_over_small_middle"] = middle_rounds(big["round_seconds"]) / middle_rounds(ref["round_seconds"])
        out["large"] = {
            "clients": scale_clients,
            "run": big,
            "reference": ref,
            "overrides": [large_settings(clients)[0], f"{LARGE_EXAMPLES_PER_CLIENT} training examples per client"],
            "goal": f"peak memory < 8 GiB; round 2 <= 1.5 x the {clients}-client round 2",
            "server_state": server_state_per_node((clients, scale_clients // 2, scale_clients)),
            "engine_floor": engine_floor(ref, clients, scale_clients, per_round),
        }
        if not quick:
            save_large(out, scale_clients)
    else:
        out["large_saved"] = load_large()
    return out


def engine_floor(reference: dict[str, Any], small: int, large: int, per_round: int) -> dict[str, Any]:
    """Flower's engine alone with the same traffic (:mod:`bench.engine_floor`, nothing from the
    project) at ``small`` and ``large`` nodes: its client spends ``work_ms`` of CPU per training
    message, set so that its ``small``-node rounds take as long as the ``reference`` run's (the
    middle rounds' median, fitted as a line through two runs at :data:`ENGINE_PROBES_MS`); then
    both sizes at that work with the node-info queries, and without them."""
    probes = {
        w: middle_rounds(engine_rounds(small, w, True, LARGE_ROUNDS, per_round)["round_seconds"])
        for w in ENGINE_PROBES_MS
    }
    (w0, t0), (w1, t1) = probes.items()
    work = max(0.0, w0 + (middle_rounds(reference["round_seconds"]) - t0) * (w1 - w0) / (t1 - t0)) if t1 > t0 else w1
    runs = {
        f"{query}-{n}": engine_rounds(n, round(work, 1), query == "query", LARGE_ROUNDS, per_round)
        for query in ("query", "no-query")
        for n in (small, large)
    }
    out: dict[str, Any] = {
        "code": "bench/engine_floor.py",
        "work_ms": round(work, 1),
        "probes": {str(w): t for w, t in probes.items()},
        "runs": runs,
    }
    for query in ("query", "no-query"):
        a, b = runs[f"{query}-{small}"]["round_seconds"], runs[f"{query}-{large}"]["round_seconds"]
        out[f"{query}_round2_ratio"], out[f"{query}_middle_ratio"] = b[1] / a[1], middle_rounds(b) / middle_rounds(a)
    return out


def save_large(figure: dict[str, Any], clients: int) -> Path:
    """``bench/scale/scale-N.json``: the whole figure 5 of a ``--scale-clients N`` run (its 1000-client
    reference included), with the machine, commit, date and command, and its section of the report as
    ``scale-N.md`` beside it."""
    from bench.results import commit, machine

    SCALE_DIR.mkdir(exist_ok=True)
    saved = {
        "machine": machine(),
        "commit": commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f"python -m bench.run --only 5 --scale-clients {clients}",
        "figure": figure,
    }
    path = SCALE_DIR / f"scale-{clients}.json"
    path.write_text(json.dumps(saved, indent=1))
    path.with_suffix(".md").write_text("\n".join(saved_markdown(saved)) + "\n")
    return path


def load_large() -> dict[str, Any] | None:
    """The saved ``--scale-clients`` figure with the most clients, or None."""
    found = sorted(SCALE_DIR.glob("scale-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return json.loads(found[-1].read_text()) if found else None
