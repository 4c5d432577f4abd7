"""The archive page of ``make results`` (bench/results_archive.py, bench/page_notes.py): a study whose
runs do not all record the deployable accuracy on one clean commit is shown, with every run, on
``RESULTS_ARCHIVE.md`` and not on ``RESULTS.md``; the main page's verdicts, runs and README block are
its own studies' alone; the decision follows the runs, and ``make results`` runs an archived study
only when named. Fake finished runs as in tests/test_results_page.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_results_page import fake_run

from bench import page_notes as notes, results, results_archive as archive, results_page as page_mod, studies

CHEAP, FULL = studies.STUDIES["cheap"], studies.STUDIES["full"]
FULL_RUNS = {"fedhm": (0.88, 0.87), "heterofl": (0.86, 0.80), "fedrolex": (0.85, 0.60)}  # (global, γ = 0.125)
DROP = {"fedhm": 0.05}  # how far below its test-batch accuracy a run's deployable one is (others: 0.02)


def full_runs(root: Path, edit=lambda variant, seed, summary: None) -> Path:
    """Seeds 0, 1 of three methods of the full study, each with its deployable accuracy (FedHM's 5 pt,
    the others' 2 pt below their test-batch one) and one clean commit, then changed by ``edit``."""
    for variant, (acc, small) in FULL_RUNS.items():
        for seed in (0, 1):
            fake_run(root, variant, seed, acc + seed / 100, small, study=FULL, seconds=600.0)
            path = studies.run_dir(FULL, "dir0.5", variant, seed, root) / "summary.json"
            summary = json.loads(path.read_text())
            for key in [k for k in summary if k.startswith("final_acc/")]:
                summary[key.replace("final_acc/", "final_deployable_acc/")] = summary[key] - (
                    0.05 if variant == "fedhm" else 0.02
                )
            summary.update(deployable_bn_stats="federated", code_commit="e59c115", code_dirty=False)
            edit(variant, seed, summary)
            path.write_text(json.dumps(summary))
    return root


def cheap_runs(root: Path) -> Path:
    """Seeds 0, 1, 2 of the cheap study's methods at Dirichlet 0.5: test-batch figures only (no
    ``final_deployable_acc/*``), like the runs that predate it."""
    for variant in CHEAP.variants:
        for seed in (0, 1, 2):
            fake_run(root, variant, seed, 0.80 + seed / 100, None if variant.startswith("fedavg") else 0.7)
    return root


def table_rows(page: str, heading: str) -> list[list[str]]:
    """The cells of the rows of the first table after ``heading`` (its header rows aside)."""
    lines = page.split(f"\n{heading}\n", 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines[first + 2 : end]]


def test_an_archived_studys_runs_are_on_the_archive_page_and_only_there(tmp_path: Path):
    root = full_runs(cheap_runs(tmp_path / "results"))
    page, readme = tmp_path / "docs" / "RESULTS.md", tmp_path / "README.md"
    readme.write_text(f"intro\n{page_mod.README_START}\nold\n{page_mod.README_END}\n")
    page.parent.mkdir()
    page_mod.write_page(root, page, tmp_path / "docs" / "fig", readme)
    main, old = page.read_text(), (tmp_path / "docs" / "RESULTS_ARCHIVE.md").read_text()
    # every run: the full study's 6 on the main page, the cheap study's 18 on the archive, none on both
    main_runs, old_runs = table_rows(main, "## Every run"), table_rows(old, "## Every run")
    assert sorted((r[0], r[2], r[3]) for r in main_runs) == [("full", v, s) for v in sorted(FULL_RUNS) for s in "01"]
    assert sorted((r[0], r[2], r[3]) for r in old_runs) == sorted(
        ("cheap", v, str(s)) for v in CHEAP.variants for s in (0, 1, 2)
    )
    # the main page's verdicts are the full study's alone (and it has some); the archive's the cheap study's
    verdicts = table_rows(main, "## Verdicts")
    assert verdicts and {r[1] for r in verdicts} == {"full"}
    assert {r[1] for r in table_rows(old, "## Verdicts")} == {"cheap"}
    assert "## Study `cheap`" in old and "## Study `cheap`" not in main and "## Study `full`" not in old
    # the capacity study has no run: nothing keeps it off the main page (its runs are missing there)
    assert "## Study `capacity`" in main and "capacity dir0.5: 30 run(s) missing" in main
    # each page says why and links to the other; the archive's reason is counted from the runs
    assert "[the archive page](RESULTS_ARCHIVE.md)" in main and "[RESULTS.md](RESULTS.md)" in old
    assert "- `cheap`: 18 of its 18 runs recorded no deployable accuracy" in old
    assert (
        "**Their verdicts are not the project's current claims**" in old and "(its studies: `capacity`, `full`)" in old
    )
    # the archived study's plots are drawn where its page points
    assert "(fig/dir0.5/accuracy_by_round.png)" in old
    assert (tmp_path / "docs" / "fig" / "dir0.5" / "accuracy_by_round.png").stat().st_size > 1000
    # the README quotes the main page's studies only, with their deployable figures: FedHM − HeteroFL is
    # (88 − 5) − (86 − 2) = −1 pt on seed 0 and on seed 1 (+2 pt test-batch)
    block = readme.read_text()
    assert "**full, Dirichlet α = 0.5**" in block and "**cheap" not in block
    assert "FedHM − HeteroFL (matched on parameters), final global accuracy: -1.00 pt, 95 % CI" in block


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda v, k, s: None, []),
        (lambda v, k, s: s.update(code_commit="abc1234") if k == 1 else None, ["its runs span 2 commits"]),
        (lambda v, k, s: s.update(code_dirty=True) if v == "fedhm" else None, ["2 run(s) on uncommitted code"]),
        (lambda v, k, s: s.pop("final_deployable_acc/global") if k == 0 else None, ["3 of its 6 runs recorded no"]),
    ],
)
def test_the_runs_decide_whether_a_study_is_archived(tmp_path: Path, change, expected):
    root = full_runs(tmp_path, change)
    why = archive.archived(root, [FULL, CHEAP])  # CHEAP: no finished run, so nothing keeps it off the main page
    assert list(why) == (["full"] if expected else [])
    for text in expected:
        assert text in "; ".join(why["full"])


def test_archive_reasons_count_each_shortfall():
    deployable = {"final_deployable_acc/global": 0.8, "code_commit": "e59c115", "code_dirty": False}
    assert notes.archive_reasons([]) == [] and notes.archive_reasons([deployable, deployable]) == []
    old = {"commit": "4d8f8ab"}  # test-batch only, its code recorded when it finished
    why = notes.archive_reasons([deployable, old, {**old, "code_commit": "unknown", "code_dirty": None}])
    assert why[0].startswith("2 of its 3 runs recorded no deployable accuracy")
    assert why[1] == "its runs span 3 commits, 1 run(s) of unknown code"


def test_make_results_runs_an_archived_study_only_when_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    root = full_runs(cheap_runs(tmp_path))
    assert results.main(["--plan", "--runs", str(root)]) == 0
    out = capsys.readouterr().out
    assert "not running the archived studies cheap (name them with --study)" in out
    assert "  full dir0.5, seed(s) 0, 1, 2: 21 run(s) missing" in out and "  cheap" not in out
    assert results.main(["--plan", "--runs", str(root), "--study", "cheap"]) == 0
    out = capsys.readouterr().out
    assert "  cheap dir0.1: 18 run(s) missing" in out and "not running" not in out


def test_the_committed_results_page_holds_only_studies_that_meet_its_standard():
    """docs/RESULTS.md's studies: every finished run under results/ recorded its deployable accuracy, all on
    one clean commit (checked here from the summaries); docs/RESULTS_ARCHIVE.md holds the others."""
    shown = {
        page: re.findall(r"^## Study `(\w+)`", (studies.ROOT / "docs" / page).read_text(), re.M)
        for page in ("RESULTS.md", "RESULTS_ARCHIVE.md")
    }
    assert shown["RESULTS.md"] and not set(shown["RESULTS.md"]) & set(shown["RESULTS_ARCHIVE.md"])
    for key in shown["RESULTS.md"]:
        runs = archive.run_summaries(studies.RUNS, studies.STUDIES[key])
        assert all("final_deployable_acc/global" in r for r in runs), key
        assert len({r.get("code_commit") for r in runs}) <= 1 and all(r.get("code_dirty") is False for r in runs), key
