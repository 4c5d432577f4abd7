"""A Hydra multirun through `flwr run` on a two-node Ray cluster, and its summary read from each job's own outputs."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_ray_cluster import RAY, distinct_ports, ray_start

from fedhm_flwr.ops.job.procs import Processes, tagged_pids
from fedhm_flwr.reporting.summary import write_summary

RATIOS = ((1, 0.25), (0.5, 0.125))


@pytest.mark.slow
def test_a_sweep_on_a_two_node_ray_cluster_has_one_row_per_job(tmp_path):
    """The sweep's jobs run their clients on an existing Ray cluster of two nodes
    (``simulation.ray_address``; head + one more node, 1 CPU each): every job completes, its clients
    train on both nodes in each round, and the summary has one row per job, each with its job's
    swept value (a list: ``levels.ratios``) and results. (One cluster for the jobs instead of a
    private Ray instance each, and no separate cluster run: this is the suite's test of
    ``simulation.ray_address``; a private instance runs in every other `flwr run` test.) Two jobs,
    one swept key: a job is a whole `flwr run` start-up (~17 s here); a summary over several swept
    keys, grouped over seeds, is checked on written runs in tests/test_statistics.py."""
    if not Path(RAY).exists():
        pytest.skip("no `ray` executable next to this Python")
    temp_dir = tempfile.mkdtemp(prefix="fedhm-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    gcs, dashboard, client_server = distinct_ports(3, set())
    procs = Processes()  # the cluster's processes carry this tag: stopped by it, and only they
    sweep_dir = tmp_path / "sweep"
    try:
        ray_start(
            procs,
            temp_dir,
            "--head",
            f"--port={gcs}",
            "--include-dashboard=false",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client_server}",
        )
        ray_start(procs, temp_dir, f"--address=127.0.0.1:{gcs}")
        cmd = [
            sys.executable,
            "-m",
            "fedhm_flwr.ops.sweeps.sweep",
            "-m",
            "levels.ratios=" + ",".join(f"[{a},{b}]" for a, b in RATIOS),
            "seed=1",
            "rounds=2",
            "num_clients=4",
            "fraction_train=1.0",
            "dataset.max_train_examples=800",
            "dataset.max_test_examples=200",
            "model.width=4",
            f"simulation.ray_address=127.0.0.1:{gcs}",
            f"hydra.sweep.dir={sweep_dir}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    finally:
        procs.close(grace=5.0, settle=1.0)
        left = tagged_pids(procs.tag)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"cluster processes left running: {left}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sorted(p for p in sweep_dir.iterdir() if p.name.startswith("job"))
    assert len(jobs) == len(RATIOS)
    for job in jobs:
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2]
        assert all(r["replies"] == 4 for r in rows)
        # 4 clients a round, one 1-CPU actor per node: both nodes train in each round
        assert [r.get("ray_nodes") for r in rows] == [2, 2], rows
    with (sweep_dir / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(RATIOS) and (sweep_dir / "summary.md").is_file()
    assert (sweep_dir / "accuracy_by_round.png").is_file() and (sweep_dir / "accuracy_vs_bytes.png").is_file()
    for row in rows:  # each row's values are those of its own job's outputs
        job = sweep_dir / row["run"]
        summary = json.loads((job / "summary.json").read_text())
        assert float(row["final_acc/global"]) == pytest.approx(summary["final_acc/global"])
        assert int(row["bytes_total"]) == summary["bytes_total"]
        config = OmegaConf.load(job / "config.yaml")
        assert int(row["seed"]) == config.seed == 1 and json.loads(row["levels.ratios"]) == list(config.levels.ratios)
        assert json.loads(row["levels.ratios"]) == summary["levels"]
    assert {tuple(json.loads(r["levels.ratios"])) for r in rows} == set(RATIOS)


def _fake_run(folder, seed, acc, ratios):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"seed: {seed}\nlevels:\n  ratios: {ratios}\nrounds: 1\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "acc/global": acc}) + "\n")
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "method": "fedhm",
                "final_acc/global": acc,
                "best_acc/global": acc,
                "bytes_total": 1000 * (seed + 1),
                "wall_seconds": 1.0,
                "rounds_completed": 1,
                "level_costs": {"1": {"params": 10}},
            }
        )
    )


def test_summary_on_demand_reads_each_run_and_finds_the_swept_keys(tmp_path):
    _fake_run(tmp_path / "a", 0, 0.5, [1.0, 0.5])
    _fake_run(tmp_path / "b", 1, 0.7, [1.0, 0.5])
    rows = write_summary([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert [r["seed"] for r in rows] == [0, 1]  # only the key that differs is a column
    assert "levels.ratios" not in rows[0]  # equal in both runs: not a swept value
    assert [r["final_acc/global"] for r in rows] == [0.5, 0.7]
    assert (tmp_path / "out" / "summary.md").read_text().count("\n") == 4
