"""What a round records: its bookkeeping (:class:`RoundLog`), the clients' training figures, the
metrics row (``metrics.jsonl``) and the one console line. Plain data in, plain data out."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedhm_flwr.core import protocol as wire
from fedhm_flwr.server.methods.method import Reply


@dataclass
class RoundLog:
    """Bookkeeping of one round (what becomes the round's output line)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    sampled: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)
    rejected: list[tuple[int, str]] = field(default_factory=list)
    level_counts: dict[str, int] = field(default_factory=dict)
    assignments: dict[str, float] = field(default_factory=dict)  # node (partition) -> level it trained
    excluded: dict[str, str] = field(default_factory=dict)  # connected node that sits out -> why
    server_seconds: float = 0.0
    query_bytes: int = 0  # node-info queries and their answers (new nodes only)
    query_seconds: float = 0.0  # wall time of those queries (part of server_seconds)
    queried: int = 0  # nodes asked for their node info this round
    late: list[int] = field(default_factory=list)  # sampled nodes the round stopped waiting for (stragglers)
    late_arrivals: int = 0  # answers to earlier rounds' messages that came after those rounds stopped waiting
    arrivals: list[float] = field(default_factory=list)  # seconds each answer took after the push (sorted)
    train_seconds: float = 0.0  # wall time from the push of the training messages to the last reply pulled


def train_metrics(valid: list[Reply]) -> dict[str, float]:
    """The round's training figures: replies, sample-weighted loss and accuracy, slowest client."""
    out: dict[str, float] = {"replies": float(len(valid))}
    if valid:
        n = np.array([r.num_examples for r in valid], dtype=np.float64)
        for key in (wire.TRAIN_LOSS, wire.TRAIN_ACCURACY):
            vals = [r.metrics.get(key, math.nan) for r in valid]
            out[key] = float(np.dot(n, vals) / n.sum())
        out["client-seconds-max"] = max(r.metrics.get(wire.SECONDS, 0.0) for r in valid)
        out["client-seconds-sum"] = sum(r.metrics.get(wire.SECONDS, 0.0) for r in valid)  # the clients' own training
        ray_nodes = {r.metrics[wire.RAY_NODE] for r in valid if wire.RAY_NODE in r.metrics}
        if ray_nodes:  # Ray simulation: on how many Ray nodes this round's clients trained
            out["ray-nodes"] = float(len(ray_nodes))
    return out


def round_row(
    server_round: int,
    lr: float,
    log_: RoundLog,
    metrics: Mapping[str, float] | None,
    columns: Mapping[str, Any],
    label: Callable[[int], str],
) -> dict[str, Any]:
    """The round's metrics row before evaluation (``columns``: the attack/defence/DP figures)."""
    row: dict[str, Any] = {
        "round": server_round,
        "lr": lr,
        "sampled": log_.sampled,
        "replies": int(metrics["replies"]) if metrics is not None else 0,
        "failures": len(log_.failures),
        "rejected": len(log_.rejected),
        "bytes_sent": log_.sent_bytes,
        "bytes_received": log_.received_bytes,
        "bytes_queries": log_.query_bytes,
        "server_seconds": log_.server_seconds,
        "query_seconds": log_.query_seconds,
        "train_seconds": log_.train_seconds,
        "queried": log_.queried,
    }
    if metrics is not None:
        for key in (wire.TRAIN_LOSS, wire.TRAIN_ACCURACY, "client-seconds-max", "client-seconds-sum"):
            if key in metrics:
                row[key.replace("-", "_")] = float(metrics[key])
        if "ray-nodes" in metrics:
            row["ray_nodes"] = int(metrics["ray-nodes"])
    for level, count in log_.level_counts.items():
        row[f"clients/level_{level}"] = count
    row["assignments"] = json.dumps(log_.assignments, sort_keys=True)
    if log_.excluded:
        row["excluded"] = json.dumps(log_.excluded, sort_keys=True)
    row.update(columns)
    if log_.late or log_.late_arrivals:
        row.update(
            {
                "late": len(log_.late),
                "late_nodes": json.dumps([label(n) for n in log_.late]),
                "late_arrivals": log_.late_arrivals,
            }
        )
    if log_.arrivals:  # what the adaptive deadline sees (stragglers.*): the answers' times after the push
        row.update({"reply_seconds_median": float(np.median(log_.arrivals)), "reply_seconds_max": log_.arrivals[-1]})
    if log_.failures or log_.rejected:
        row["failure_reasons"] = json.dumps([[label(n), why] for n, why in log_.failures + log_.rejected])
    return row


def progress_line(row: dict[str, Any], num_rounds: int, levels: list[float]) -> str:
    """The one console line of a round."""
    parts = [f"[round {row['round']}/{num_rounds}]"]
    if "acc/global" in row:
        parts.append(f"global acc {row['acc/global']:.4f} loss {row['loss/global']:.4f}")
        per_level = [f"{lvl:g}:{row[f'acc/level_{lvl:g}']:.3f}" for lvl in levels if f"acc/level_{lvl:g}" in row]
        if per_level:
            parts.append("levels " + " ".join(per_level))
    if "fed_acc/all" in row:
        parts.append(
            f"clients acc {row['fed_acc/all']:.4f} (worst10 {row['fed_acc_clients/worst10']:.3f}, "
            f"{row['fed_clients']} clients)"
        )
    if "train_loss" in row:
        parts.append(f"train loss {row['train_loss']:.4f}")
    parts.append(f"replies {row['replies']}/{row['sampled']}")
    if row["failures"] or row["rejected"]:
        parts.append(f"failures {row['failures']} rejected {row['rejected']}")
    if row.get("late"):
        parts.append(f"late {row['late']}")
    parts.append(f"sent {row['bytes_sent'] / 1e6:.2f}MB recv {row['bytes_received'] / 1e6:.2f}MB")
    parts.append(f"{row.get('seconds', 0.0):.1f}s")
    return " | ".join(parts)
