"""The generated results page (bench/results.py) reports what the runs say.

Fake finished runs with hand-picked accuracies stand in for the 36 real ones; the page's
FedHM − HeteroFL sentence, its tables and the README block are checked against values computed
here by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import results

FEDHM = [0.80, 0.82, 0.84]
HETEROFL = [0.79, 0.80, 0.81]  # FedHM − HeteroFL per seed: +1, +2, +3 pt


def fake_run(root: Path, variant: str, seed: int, acc: float) -> None:
    path = results.run_dir("dir0.5", variant, seed, root)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"seed: {seed}\nmethod:\n  name: {variant}\n")
    rounds = [{"round": r, "acc/global": acc - 0.01 * (3 - r), "acc/level_0.5": acc - 0.05} for r in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {"method": variant, "final_acc/global": acc, "final_acc/level_1": acc, "final_acc/level_0.5": acc - 0.05,
               "bytes_total": 2e6, "wall_seconds": 120.0, "rounds_completed": 3, "commit": "abc1234",
               "machine": "x86_64, 2 cores, no GPU", "finished_at": "2026-11-23 12:00 UTC",
               "level_costs": {"1": {"params": 1000, "macs": 5000}, "0.5": {"params": 600, "macs": 3000}}}
    (path / "summary.json").write_text(json.dumps(summary))


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    for seed, (a, b) in enumerate(zip(FEDHM, HETEROFL)):
        fake_run(root, "fedhm", seed, a)
        fake_run(root, "heterofl", seed, b)
    partial = results.run_dir("dir0.5", "fedrolex", 0, root).parent / ".seed0.partial"
    partial.mkdir(parents=True)  # an interrupted run: neither counted nor shown
    return root


def test_page_states_the_paired_difference_with_its_t_interval(runs: Path, tmp_path: Path):
    page = results.render(runs, (0, 1, 2), tmp_path / "fig", tmp_path / "RESULTS.md")
    # differences 1, 2, 3 pt: mean 2, sd 1, t(0.975, df 2) = 4.302653 -> half width 4.302653 / sqrt(3) = 2.4841
    assert "FedHM − HeteroFL (budget-matched), final global accuracy: +2.00 pt, 95 % CI [-0.48, +4.48] over 3 paired seeds" in page
    assert "the interval contains 0" in page
    # the headline row of FedHM: mean 82.00, sd 2.00, CI 82 ± 4.302653 * 2 / sqrt(3) = [77.03, 86.97]
    assert "| FedHM | 3 | 82.00 ± 2.00 | [77.03, 86.97] |" in page
    assert "runs 6 of 36" in page  # the partial run is not a finished one
    for plot in ("accuracy_by_round", "accuracy_vs_bytes", "accuracy_vs_params", "accuracy_vs_macs"):
        assert (tmp_path / "fig" / "dir0.5" / f"{plot}.png").stat().st_size > 1000
        assert f"fig/dir0.5/{plot}.png" in page


def test_missing_runs_are_the_unfinished_ones(runs: Path):
    todo = results.missing(runs, (0, 1, 2))
    assert len(todo) == 36 - 6
    assert ("dir0.5", "fedhm", 0, str(runs)) not in todo and ("dir0.5", "fedrolex", 0, str(runs)) in todo
    assert [job[2] for job in todo] == sorted(job[2] for job in todo)  # seed by seed


def test_readme_block_is_replaced_and_nothing_else(runs: Path, tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{results.README_START}\nold\n{results.README_END}\noutro\n")
    results.update_readme(readme, results.readme_block(runs, (0, 1, 2)))
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old" not in text
    assert "+2.00 pt, 95 % CI [-0.48, +4.48]" in text
    readme.write_text("no block\n")
    with pytest.raises(SystemExit, match="results:start"):
        results.update_readme(readme, "x")
