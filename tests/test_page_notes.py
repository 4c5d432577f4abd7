"""What the results pages state besides the numbers (bench/page_notes.py): which batch-norm
statistics their accuracies used, the code versions of a study's runs (flagged when mixed), the
training options that differ by method, and the capacity probe's seeds kept off the studies'.
Fake finished runs as in tests/test_results_page.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_results_page import RUNS, fake_run

from bench import page_notes as notes, results_page as page_mod, studies as results

CHEAP = results.STUDIES["cheap"]
ROOT = Path(__file__).resolve().parents[1]


def _runs(root: Path, edit=lambda variant, seed, summary: None) -> Path:
    """The fake runs of dir0.5 (3 seeds), each summary then changed by ``edit``."""
    for variant, (accs, smalls) in RUNS.items():
        for seed, acc in enumerate(accs):
            fake_run(root, variant, seed, acc, None if smalls is None else smalls[seed])
            path = results.run_dir(CHEAP, "dir0.5", variant, seed, root) / "summary.json"
            summary = json.loads(path.read_text())
            edit(variant, seed, summary)
            path.write_text(json.dumps(summary))
    return root


def _deployable(variant, seed, summary):
    """Every run recorded a deployable figure 10 pt below its test-batch one, with one clean commit."""
    for key in [k for k in summary if k.startswith("final_acc/")]:
        summary[key.replace("final_acc/", "final_deployable_acc/")] = summary[key] - 0.10
    summary.update(bn_stats="test_batch", deployable_bn_stats="federated", code_commit="abc1234", code_dirty=False)


def test_a_study_whose_runs_all_recorded_it_is_shown_with_the_deployable_accuracy(tmp_path):
    page = page_mod.render(_runs(tmp_path / "r", _deployable), [CHEAP], tmp_path / "fig", tmp_path / "R.md")
    # FedHM's final global accuracies 80, 82, 84 -> deployable 70, 72, 74: mean 72, sd 2
    assert "| FedHM | 3 | 72.00 ± 2.00 |" in page and "| FedHM | 3 | 82.00" not in page
    assert "every accuracy below is **deployable**" in page and "`federated`: 18 run(s)" in page
    code = [line for line in page.split("## Study")[1].splitlines() if line.startswith("- code versions:")]
    assert code == ["- code versions: `abc1234`: 18 run(s)"]  # one clean commit: not flagged
    assert "the transport is the only difference" in page


def test_a_study_with_a_run_without_it_is_shown_with_test_batch_figures_and_says_so(tmp_path):
    def all_but_one(variant, seed, summary):
        if (variant, seed) != ("heterofl", 1):
            _deployable(variant, seed, summary)

    page = page_mod.render(_runs(tmp_path / "r", all_but_one), [CHEAP], tmp_path / "fig", tmp_path / "R.md")
    assert "| FedHM | 3 | 82.00 ± 2.00 |" in page  # never a mix of the two figures
    assert "17 of these 18 runs recorded the deployable figure" in page
    assert "**deployable figures need a re-run of the study's runs**" in page


def test_runs_of_several_commits_or_uncommitted_code_flag_the_study(tmp_path):
    def mixed(variant, seed, summary):
        if seed == 2:  # code recorded at the start, uncommitted; the others only at the finish (abc1234)
            summary.update(code_commit="def5678", code_dirty=True)

    page = page_mod.render(_runs(tmp_path / "r", mixed), [CHEAP], tmp_path / "fig", tmp_path / "R.md")
    line = next(x for x in page.splitlines() if x.startswith("- code versions:"))
    assert "`abc1234 (recorded when the run finished)`: 12 run(s)" in line
    assert "`def5678 (with uncommitted changes)`: 6 run(s)" in line
    assert "**flagged: the runs span 2 commits, 6 run(s) on uncommitted code" in line
    assert "the transport is not the only difference" in page
    assert "| cheap | dir0.5 | fedhm | 2 | grid | 84.00 | 300 | def5678 (with uncommitted changes) |" in page
    lines, flagged = notes.code_lines([{"code_commit": "unknown", "code_dirty": None}])
    assert flagged and "1 run(s) of unknown code" in lines[0]


def test_the_recipe_table_states_each_methods_clipping_as_its_config_sets_it():
    common = OmegaConf.load(ROOT / "conf" / "config.yaml").train.grad_clip
    clip = {m: OmegaConf.load(ROOT / "conf" / "method" / f"{m}.yaml").grad_clip for m in ("heterofl", "fedrolex")}
    table = notes.recipe_lines({page_mod.LABELS[v]: CHEAP.overrides("dir0.5", v, 0) for v in CHEAP.variants})
    rows = {tuple(c.strip() for c in line.split("|")[1:4]) for line in table if line.startswith("| ")}
    for method, label in (("heterofl", "HeteroFL (matched)"), ("fedrolex", "FedRolex (matched)")):
        assert (label, "`grad_clip`", repr(float(clip[method]))) in rows and clip[method] != common
    assert not any(r[1] == "`grad_clip`" for r in rows if r[0].startswith(("FedHM", "FedAvg")))
    assert ("FedHM + self-distillation", "`distill`", "True") in rows
    assert f"`grad_clip` = {float(common)!r}" in table[0]


def test_each_hook_and_aggregation_is_described_as_its_own_method_does_it():
    methods = {"FjORD": "method=fjord model.width=8", "FIARSE": "method=fiarse model.width=8"}
    rows = [line for line in notes.recipe_lines(methods) if line.startswith("| F")]
    for label, doc in (("FjORD", "#fjord"), ("FIARSE", "#fiarse")):
        mine = [r for r in rows if r.startswith(f"| {label} |")]
        assert mine and all(doc in r for r in mine), mine  # not another method's description
    hook_options = [r for r in rows if "`hook_options`" in r]
    assert len(hook_options) == 2 and "threshold" in hook_options[1] and "widths" in hook_options[0]
    aggregation = {line.split("|")[1].strip(): line for line in notes.aggregation_lines(methods) if "|" in line}
    assert "server's learning rate 1" in aggregation["FIARSE"] and "non-zero" in aggregation["FIARSE"]
    assert "learning rate" not in aggregation["FjORD"]


def test_the_capacity_probe_refuses_seeds_of_a_study():
    from bench import capacity_probe as probe

    taken = sorted({k for st in results.STUDIES.values() for k in st.seeds})
    with pytest.raises(SystemExit, match=r"--seeds: 2 also seed.*disjoint"):
        probe.main(["--seeds", "2", "100", "--no-run"])
    assert not set(probe.DEFAULT_SEEDS) & set(taken)
    probe.check_seeds(probe.DEFAULT_SEEDS)  # no error
