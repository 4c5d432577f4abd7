"""A 2 x 2 Hydra multirun through `flwr run`, and its summary read from each job's own outputs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from fedhm_flwr.summary import write_summary


@pytest.mark.slow
def test_two_by_two_sweep_summary_has_one_row_per_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fedhm_flwr.sweep", "-m", "levels.ratios=[1,0.25],[0.5,0.125]", "seed=0,1",
           "rounds=1", "num_clients=3", "dataset.max_train_examples=600", "dataset.max_test_examples=200",
           "model.width=4", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sorted(p for p in sweep_dir.iterdir() if p.name.startswith("job"))
    assert len(jobs) == 4
    with (sweep_dir / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4 and (sweep_dir / "summary.md").is_file()
    assert (sweep_dir / "accuracy_by_round.png").is_file() and (sweep_dir / "accuracy_vs_bytes.png").is_file()
    for row in rows:  # each row's values are those of its own job's outputs
        job = sweep_dir / row["run"]
        summary = json.loads((job / "summary.json").read_text())
        assert float(row["final_acc/global"]) == pytest.approx(summary["final_acc/global"])
        assert int(row["bytes_total"]) == summary["bytes_total"]
        config = (job / "config.yaml").read_text()
        assert f"seed: {row['seed']}" in config
        assert json.loads(row["levels.ratios"]) == summary["levels"]
    swept = {(tuple(json.loads(r["levels.ratios"])), int(r["seed"])) for r in rows}
    assert swept == {(ratios, seed) for ratios in ((1, 0.25), (0.5, 0.125)) for seed in (0, 1)}


def _fake_run(folder, seed, acc, ratios):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"seed: {seed}\nlevels:\n  ratios: {ratios}\nrounds: 1\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "acc/global": acc}) + "\n")
    (folder / "summary.json").write_text(json.dumps({
        "method": "fedhm", "final_acc/global": acc, "best_acc/global": acc, "bytes_total": 1000 * (seed + 1),
        "wall_seconds": 1.0, "rounds_completed": 1, "level_costs": {"1": {"params": 10}}}))


def test_summary_on_demand_reads_each_run_and_finds_the_swept_keys(tmp_path):
    _fake_run(tmp_path / "a", 0, 0.5, [1.0, 0.5])
    _fake_run(tmp_path / "b", 1, 0.7, [1.0, 0.5])
    rows = write_summary([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert [r["seed"] for r in rows] == [0, 1]  # only the key that differs is a column
    assert "levels.ratios" not in rows[0]  # equal in both runs: not a swept value
    assert [r["final_acc/global"] for r in rows] == [0.5, 0.7]
    assert (tmp_path / "out" / "summary.md").read_text().count("\n") == 4
