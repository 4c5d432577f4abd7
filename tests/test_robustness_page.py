"""docs/ROBUSTNESS.md's generator (bench/robustness.py) on fake runs: its intervals against a hand
computation, paired differences, the resolution sentence, the DP table, incomplete grids."""

from __future__ import annotations

import json
import math

from bench import robustness as rb
from bench.robustness import Cell

#: t_{0.975, 2}: Student's t table, two degrees of freedom (three seeds)
T2 = 4.302652729911275


def _fake(root, cell, accs, **extra):
    for seed, acc in enumerate(accs):
        path = cell.path(seed, root)
        path.mkdir(parents=True)
        data = {"final_acc/global": acc, "seconds": 10.0, "commit": "abc1234", "machine": "test box",
                "attackers_sampled": 4, "rejected": 1, **extra}
        (path / "summary.json").write_text(json.dumps(data))


def test_the_page_shows_t_intervals_and_paired_differences_computed_by_hand(tmp_path):
    _fake(tmp_path, Cell("fedhm", "clean", "none"), [0.80, 0.82, 0.84])
    _fake(tmp_path, Cell("fedhm", "scale-10", "median"), [0.79, 0.80, 0.84])
    _fake(tmp_path, Cell("fedhm", "scale-30", "none"), [0.10, 0.11, 0.12])
    _fake(tmp_path, Cell("heterofl", "clean", "none"), [0.75])
    _fake(tmp_path, Cell("fedhm", "dp-off", "none"), [0.70, 0.72, 0.74])
    _fake(tmp_path, Cell("fedhm", "dp-sigma1", "none"), [0.60, 0.61, 0.65], dp_epsilon=3.214)
    (tmp_path / "fedhm" / "clean" / "clip" / ".seed0.partial").mkdir(parents=True)  # an interrupted run: not counted
    page = rb.render(tmp_path, (0, 1, 2))

    # clean: mean 82, sample std 2 -> half-width t * 2 / sqrt(3) = 4.97
    half = T2 * 2.0 / math.sqrt(3)
    assert f"{half:.1f}" == "5.0"
    assert "| no attack | 82.0 ± 5.0 |" in page
    # scale-10 median: differences -1, -2, 0 (points): mean -1, std 1 -> +-2.5, interval contains 0: no *
    half1 = T2 * 1.0 / math.sqrt(3)
    assert f"{half1:.1f}" == "2.5"
    # its accuracies 79, 80, 84: mean 81, std sqrt(7) -> half-width 6.6
    assert f"{T2 * math.sqrt(7) / math.sqrt(3):.1f}" == "6.6"
    assert "| scaled update (×100) | – | – | 81.0 ± 6.6 (-1.0 ± 2.5) |" in page
    # scale-30 undefended: 11 +- 2.5, differences -70, -71, -72: -71.0 +- 2.5, resolved (*)
    assert "| scaled update (×100) | 11.0 ± 2.5 (-71.0 ± 2.5*) |" in page
    assert "| no attack | 75.0 (n=1) |" in page  # one seed: no interval
    # DP: differences -10, -11, -9 against the no-DP run of the same federation
    assert "| 1 | 0.01 | 3.21 | 62.0 ± 6.6 | -10.0 ± 2.5* |" in page
    assert "| no DP | 0 | ∞ | 72.0 ± 5.0 | – |" in page
    assert "| 0.5 | – | – | – | – |" in page
    # the resolution sentence: three paired differences, each half-width 2.48
    assert "Over the 3 paired differences on this page the 95% interval's half-width has median 2.5 points" in page
    assert "with n = 3 seeds t = 4.30" in page
    total = len(rb.cells()) * 3
    assert f"- runs: 16 of {total}" in page and "the grid is not complete" in page
    assert page.count("| fedhm | scale-30 | none |") == 3


def test_missing_runs_come_cell_by_cell_and_the_status_counts_them(tmp_path):
    _fake(tmp_path, Cell("fedhm", "clean", "none"), [0.8, 0.8])
    todo = rb.missing(tmp_path, (0, 1, 2))
    assert todo[0][:2] == (Cell("fedhm", "clean", "none"), 2)
    assert [t[1] for t in todo[1:4]] == [0, 1, 2] and {t[0] for t in todo[1:4]} == {Cell("fedhm", "dp-off", "none")}
    assert len(todo) == len(rb.cells()) * 3 - 2
    assert not any(c.dp for c, _, _ in rb.missing(tmp_path, (0,), dp=False))
    assert rb.status(tmp_path, (0, 1, 2), 2).startswith(f"2 run(s) finished, {len(todo)} missing")
    cell = Cell("heterofl", "sign_flip-30", "trimmed_mean")
    assert (cell.attack, cell.fraction) == ("sign_flip", 0.3)
    assert "failures.attack.fraction=0.3" in cell.overrides(0) and "method=heterofl" in cell.overrides(0)
    assert "dp.noise_multiplier=2" in Cell("fedhm", "dp-sigma2", "none").overrides(1)
    assert "dp.enabled" not in Cell("fedhm", "dp-off", "none").overrides(1)
