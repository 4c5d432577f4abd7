"""docs/ROBUSTNESS.md's generator (bench/robustness.py) on fake runs: its intervals against a hand
computation, paired differences, the resolution sentence, the DP table (with dp-accounting's PLD ε
beside the runs' RDP ε), incomplete grids, and the malformed-reply table of a fake fuzz campaign."""

from __future__ import annotations

import json
import math
import re

import dp_accounting

from bench import robustness as rb, robustness_fuzz as rf
from bench.robustness_grid import Cell

#: t_{0.975, 2}: Student's t table, two degrees of freedom (three seeds)
T2 = 4.302652729911275
#: a DP run's record as the server loop writes it: q is its fraction_train override, ε the RDP one it logged
DP_RUN = {
    "overrides": "rounds=20 num_clients=500 fraction_train=0.2 dp.enabled=true dp.noise_multiplier=1",
    "dp_noise_multiplier": 1.0,
    "rounds_completed": 20,
    "dp_delta": 1e-5,
    "dp_epsilon": 8.514880382861215,
}


def _pld(q, sigma, rounds, delta):
    """dp-accounting's PLD ε, computed here independently of the generator."""
    accountant = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def _fake(root, cell, accs, **extra):
    for seed, acc in enumerate(accs):
        path = cell.path(seed, root)
        path.mkdir(parents=True)
        data = {
            "final_acc/global": acc,
            "seconds": 10.0,
            "commit": "abc1234",
            "machine": "test box",
            "attackers_sampled": 4,
            "rejected": 1,
            **extra,
        }
        (path / "summary.json").write_text(json.dumps(data))


def test_the_page_shows_t_intervals_and_paired_differences_computed_by_hand(tmp_path):
    _fake(tmp_path, Cell("fedhm", "clean", "none"), [0.80, 0.82, 0.84])
    _fake(tmp_path, Cell("fedhm", "scale-10", "median"), [0.79, 0.80, 0.84])
    _fake(tmp_path, Cell("fedhm", "scale-30", "none"), [0.10, 0.11, 0.12])
    _fake(tmp_path, Cell("heterofl", "clean", "none"), [0.75])
    _fake(tmp_path, Cell("fedhm", "dp-off", "none"), [0.70, 0.72, 0.74])
    _fake(tmp_path, Cell("fedhm", "dp-sigma1", "none"), [0.60, 0.61, 0.65], **DP_RUN)
    (tmp_path / "fedhm" / "clean" / "clip" / ".seed0.partial").mkdir(parents=True)  # an interrupted run: not counted
    page = rb.render(tmp_path, (0, 1, 2), fuzz=tmp_path / "no-fuzz.json")

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
    # ε: the run's own (RDP), and dp-accounting's PLD for q = 0.2, σ = 1, 20 rounds, δ = 1e-5
    pld = _pld(0.2, 1.0, 20, 1e-5)
    assert abs(pld - 6.62) < 0.01 and pld < DP_RUN["dp_epsilon"]
    assert f"| 1 | 0.01 | 8.51 | {pld:.2f} | 62.0 ± 6.6 | -10.0 ± 2.5* |" in page
    assert "| no DP | 0 | ∞ | ∞ | 72.0 ± 5.0 | – |" in page
    assert "| 0.5 | – | – | – | – | – |" in page
    assert "used the project's RDP accountant" in page and "`dp_accounting.pld.PLDAccountant`" in page
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


def test_the_pld_epsilon_uses_each_runs_own_parameters_and_only_where_they_give_back_its_rdp_epsilon():
    from fedhm_flwr.math.privacy import compute_rdp, epsilon_from_rdp

    run = {
        **DP_RUN,
        "overrides": "fraction_train=0.1",
        "dp_noise_multiplier": 2.0,
        "rounds_completed": 7,
        "dp_delta": 1e-6,
    }
    run["dp_epsilon"] = epsilon_from_rdp(compute_rdp(0.1, 2.0, 7), 1e-6)[0]
    assert rf.dp_parameters(run) == (0.1, 2.0, 7, 1e-6)
    assert rf.pld_text(run) == f"{_pld(0.1, 2.0, 7, 1e-6):.2f}"
    assert rf.dp_parameters({**run, "dp_q": 0.3, "dp_sigma": 1.5}) == (0.3, 1.5, 7, 1e-6)  # per-round records win
    assert rf.pld_text({**run, "dp_epsilon": 3.214}) == "–"  # parameters that do not give the logged ε
    assert rf.pld_text({k: v for k, v in run.items() if k != "rounds_completed"}) == "–"


FUZZ = {
    "commit": "abc1234",
    "dirty": True,
    "minutes": 30.0,
    "replies_tried": 3000,
    "malformed_replies": 2100,
    "rounds": 70,
    "configs": ["fedhm none", "fedhm clip"],
    "escaped": 0,
    "non_finite_models": 0,
    "classes": [
        {
            "class": "int-arrays",
            "what": "every floating array sent back as int64",
            "tried": 1234,
            "refused": 1234,
            "accepted": 0,
            "rounds": 40,
            "rounds_survived": 40,
            "model_finite": 39,
            "reasons": {
                "conv1.weight is int64, level 1 was sent float32": 1000,
                "fc.bias is int64, level 3 was sent float32": 200,
                "x" * 200: 34,
            },
        },
        {
            "class": "nan-values",
            "what": "a NaN | in one array",
            "tried": 1766,
            "refused": 1700,
            "accepted": 66,
            "rounds": 30,
            "rounds_survived": 29,
            "model_finite": 30,
            "reasons": {"reply from node 17 has non-finite values in conv2.weight " + "y" * 100: 1700},
        },
        {
            "class": "fine",
            "what": "a well-formed reply",
            "tried": 5,
            "refused": 0,
            "accepted": 5,
            "rounds": 5,
            "rounds_survived": 5,
            "model_finite": 5,
            "reasons": {},
        },
    ],
}


def _rows(page):
    """The malformed-reply table's rows, cell by cell (escaped pipes kept inside their cell)."""
    body = page.split(rf.TITLE, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


def test_the_malformed_reply_table_shows_the_fuzz_files_numbers(tmp_path):
    path = tmp_path / "fuzz" / "fuzz.json"
    path.parent.mkdir()
    path.write_text(json.dumps(FUZZ))
    page = rb.render(tmp_path / "runs", (0,), fuzz=path)
    assert (
        "`python -m bench.fuzz --minutes 30`" in page
        and "3000 replies tried (2100 of them malformed" in page
        and "over 70 rounds" in page
    )
    assert "`abc1234` (with uncommitted changes)" in page and "`fedhm none`, `fedhm clip`" in page
    rows = _rows(page)
    assert len(rows) == len(FUZZ["classes"])
    for cells, c in zip(rows, FUZZ["classes"]):
        assert cells[0] == f"`{c['class']}`"
        assert [int(cells[2]), int(cells[3])] == [c["tried"], c["refused"]]
        assert cells[5] == f"{c['rounds_survived']} of {c['rounds']}"
        assert cells[6] == f"{c['model_finite']} of {c['rounds']}"
    int_arrays, nan_values, fine = (r[4] for r in rows)
    # the two most frequent reasons with their counts, and how many others
    assert int_arrays == (
        "conv1.weight is int64, level 1 was sent float32 (1000); "
        "fc.bias is int64, level 3 was sent float32 (200); 1 other reason(s)"
    )
    reason = nan_values.rsplit(" (", 1)
    assert reason[1] == "1700)" and len(reason[0]) <= rf.REASON_WIDTH and reason[0].endswith("…")
    assert fine == "–"
    assert "a NaN \\| in one array" in page  # a pipe in the text does not break the table


def test_without_a_fuzz_file_the_section_says_it_has_not_been_run(tmp_path):
    page = rb.render(tmp_path, (0,), fuzz=tmp_path / "fuzz.json")
    section = page.split(rf.TITLE, 1)[1].split("\n## ", 1)[0]
    assert "has not been run" in section and "`python -m bench.fuzz --minutes N`" in section
    assert "| class |" not in section
