"""The full study of ``make results`` (bench/studies.py, bench/estimates.py, bench/results_progress.py):
its runs in the order the issue asks for, its time estimate from the probe's seconds per round, the
page's finished and missing runs read from the folders, and the same study on a fake CIFAR-10
folder through the one command a user types."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from data_helpers import REPO, fake_cifar10
from test_results_page import fake_run

from bench import estimates, results, results_page as page_mod, studies

FULL, CHEAP = studies.STUDIES["full"], studies.STUDIES["cheap"]
METHODS = (
    "fedhm",
    "heterofl",
    "fedrolex",
    "heterofl_memory",
    "fedrolex_memory",
    "fedavg",
    "fedavg_smallest",
    "fjord",
    "fiarse",
)
# hand-picked probe rows: (seconds of each round, evaluation included; seconds of its evaluation), job seconds
PROBE = {
    "fedhm": ([20.0, 30.0, 60.0], [4.0, 6.0, 30.0], 150.0),  # training 16, 24, 30 -> 24; evaluation 6
    "heterofl": ([12.0, 10.0, 40.0], [2.0, 2.0, 20.0], 90.0),  # training 10, 8, 20 -> 10; evaluation 2
}


def fake_probe(root: Path) -> None:
    for variant, (seconds, evals, job) in PROBE.items():
        path = root / "full" / "rounds3" / "dir0.5" / variant / "seed0"
        path.mkdir(parents=True)
        (path / "config.yaml").write_text("rounds: 3\n")
        rows = [{"round": i + 1, "seconds": s, "eval_seconds": e} for i, (s, e) in enumerate(zip(seconds, evals))]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "summary.json").write_text(json.dumps({"wall_seconds": job - 3, "job_seconds": job}))


def by_hand(train: float, per_eval: float, job: float) -> float:
    """A full-study run from a probe of 3 evaluated rounds: what the probe spent outside its rounds'
    median training and evaluation, plus the study's rounds and its evaluated rounds (every
    FULL_EVERY-th and the last, counted here)."""
    rounds, every = studies.FULL_ROUNDS, studies.FULL_EVERY
    evaluated = sum(1 for r in range(1, rounds + 1) if r % every == 0 or r == rounds)
    return job - 3 * train - 3 * per_eval + rounds * train + evaluated * per_eval


def test_full_study_runs_the_lead_seeds_of_every_method_first(tmp_path: Path):
    lead = [("dir0.5", v, k) for k in (0, 1, 2) for v in METHODS]
    rest = [("dir0.1", v, k) for k in (0, 1, 2) for v in METHODS] + [("dir0.5", v, k) for k in (3, 4) for v in METHODS]
    todo = studies.missing(tmp_path, [FULL])
    assert [(j.setting, j.variant, j.seed) for j in todo] == lead + rest  # 27 + 27 + 18
    fake_run(tmp_path, "heterofl", 1, 0.8, 0.7, study=FULL, seconds=60.0)
    left = [(j.setting, j.variant, j.seed) for j in studies.missing(tmp_path, [FULL])]
    assert left == [r for r in lead + rest if r != ("dir0.5", "heterofl", 1)]
    # the whole data set, 50 clients, 10 per round; the memory-matched variants differ in levels.match only
    from fedhm_flwr.config import load_config

    for variant, match in (("heterofl", "fedhm_params"), ("fedrolex_memory", "fedhm_memory")):
        cfg = load_config(FULL.overrides("dir0.1", variant, 2))
        assert (cfg.levels.match, cfg.num_clients, cfg.fraction_train) == (match, 50, 0.2)
        assert (cfg.dataset.max_train_examples, cfg.dataset.max_test_examples, cfg.partition.alpha) == (0, 0, 0.1)


def test_estimates_come_from_the_probe_seconds_per_round(tmp_path: Path):
    fake_probe(tmp_path)
    for variant in ("fedhm", "heterofl", "fedrolex", "fedavg"):  # the cheap study's times: 300, 100, 110, 200 s
        fake_run(tmp_path, variant, 0, 0.8, None if "fedavg" in variant else 0.7)
    fedhm, heterofl = by_hand(24.0, 6.0, 150.0), by_hand(10.0, 2.0, 90.0)
    assert estimates.projected_seconds(tmp_path) == {
        ("full", "fedhm"): pytest.approx(fedhm),
        ("full", "heterofl"): pytest.approx(heterofl),
    }
    measured, projected = estimates.measured_seconds(tmp_path), estimates.projected_seconds(tmp_path)
    ratio = (fedhm / 300 + heterofl / 100) / 2  # the median of two ratios full / cheap
    expected = {
        "fedhm": (fedhm, "probe"),
        "heterofl": (heterofl, "probe"),
        "heterofl_memory": (heterofl, "probe (as heterofl's)"),
        "fedrolex": (110 * ratio, "cheap × ratio"),
        "fedrolex_memory": (110 * ratio, "cheap × ratio (as fedrolex's)"),
        "fedavg": (200 * ratio, "cheap × ratio"),
        "fedavg_smallest": (None, "nothing measured"),
        "fjord": (heterofl, "probe (as heterofl's)"),
        "fiarse": (200 * ratio, "cheap × ratio (as fedavg's)"),
    }
    for variant, (seconds, source) in expected.items():
        got = estimates.estimate(measured, projected, "full", variant)
        assert got[1] == source and (got[0] == pytest.approx(seconds) if seconds else got[0] is None), variant
    lines = estimates.plan(tmp_path, studies.missing(tmp_path, [FULL]), 2)
    lead = 3 * (fedhm + 3 * heterofl + 2 * 110 * ratio + 2 * 200 * ratio)  # fedavg_smallest: not estimated
    assert lines[0] == (
        f"  full dir0.5, seed(s) 0, 1, 2: 27 run(s) missing (0 on Ray), estimated {estimates.hours(lead)} of run "
        "time + 3 run(s) with nothing measured yet"
    )
    assert lines[1] == (
        "    estimated from: 6 run(s): cheap × ratio; 3 run(s): cheap × ratio (as fedavg's); 3 run(s): cheap × ratio "
        "(as fedrolex's); 3 run(s): nothing measured; 6 run(s): probe; 6 run(s): probe (as heterofl's)"
    )
    assert [line.split(":")[0] for line in lines if line.startswith("  full")] == [
        "  full dir0.5, seed(s) 0, 1, 2",
        "  full dir0.1, seed(s) 0, 1, 2",
        "  full dir0.5, seed(s) 3, 4",
    ]
    assert f"  [probe]: {estimates.SOURCES['probe']} (2 run(s) in full/rounds3/)" in lines
    assert lines[-1].startswith("make results: 72 run(s) missing") and lines[-1].endswith("(+ 8 run(s) not estimated)")


def test_page_lists_what_is_finished_and_what_is_missing(tmp_path: Path):
    page = page_mod.render(tmp_path, [FULL], tmp_path / "fig", tmp_path / "RESULTS.md")  # nothing finished
    assert "0 of 72 runs finished; 72 missing" in page and page.count("No finished run yet.") == 2
    assert "| Dirichlet α = 0.1 (strongly non-IID) | FedHM | – | 0, 1, 2 | not estimated |" in page
    fake_probe(tmp_path)
    fake_run(tmp_path, "fedhm", 0, 0.85, 0.8, study=FULL, seconds=1800.0)  # one seed: tables of n = 1
    fake_run(tmp_path, "heterofl", 0, 0.84, 0.7, study=FULL, seconds=900.0)
    page = page_mod.render(tmp_path, [FULL], tmp_path / "fig", tmp_path / "RESULTS.md")
    assert "2 of 72 runs finished; 70 missing" in page
    # the probe's figures by hand: medians 24 s (training) and 6 s (evaluation), 150 − 3 × 24 − 3 × 6 = 60 s besides
    assert (
        "`full/rounds3/dir0.5/fedhm/seed0`" in page
        and "24.0 s per round of training, 6.0 s per evaluation, 60 s" in page
    )
    assert "| Dirichlet α = 0.5 | FedHM | 0 | 1, 2, 3, 4 | 30 min each (finished runs) |" in page
    assert (
        "| Dirichlet α = 0.5 | HeteroFL (memory-matched) | – | 0, 1, 2, 3, 4 | 15 min each "
        "(finished runs (as heterofl's)) |" in page
    )
    assert "| Dirichlet α = 0.1 (strongly non-IID) | FedHM | – | 0, 1, 2 | 30 min each (finished runs) |" in page
    assert "| full | dir0.5 | fedhm | 0 | grid | 85.00 |" in page and "+1.00 pt on one seed (no CI)" in page
    assert (tmp_path / "fig" / "full" / "dir0.5" / "accuracy_by_round.png").stat().st_size > 1000
    # the CIFAR-10 study is on the page only once it has a run
    assert [s.key for s in page_mod.shown_studies(tmp_path)] == ["cheap", "capacity", "full"]


def test_plan_command_prints_the_full_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert results.main(["--plan", "--study", "full", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("  full dir0.5, seed(s) 0, 1, 2: 27 run(s) missing")
    assert out[-1].startswith(f"make results: 72 run(s) missing under {tmp_path}")
    for bad, message in ((["--rounds", "0"], "--rounds: 0"), (["--data-dir", "a b"], "--data-dir: 'a b'")):
        with pytest.raises(SystemExit, match=message):
            results.main(["--plan", "--study", "full", "--runs", str(tmp_path), *bad])
    # CIFAR-10 where there is none: refused before any run starts, naming the folder looked for
    nowhere = ["--runs", str(tmp_path), "--data-dir", str(tmp_path / "none"), "--page", str(tmp_path / "p.md")]
    with pytest.raises(SystemExit, match=r"cifar10 not found: no folder .*none/cifar-10-batches-py"):
        results.main(["--study", "full_cifar10", *nowhere])
    assert not (tmp_path / "full_cifar10").exists() and not (tmp_path / "p.md").exists()


@pytest.mark.slow
def test_full_study_on_a_fake_cifar10_folder_in_one_command(tmp_path: Path):
    # 1,000 training images for 50 clients; 50 test images (what the run scores: every level, each export)
    folder = fake_cifar10(tmp_path / "data", n_per_batch=200, n_test=50)
    # the fake files cannot match torchvision's md5 sums: its check is switched off in the subprocess only
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        textwrap.dedent("""
        import torchvision.datasets.cifar as cifar
        cifar.check_integrity = lambda *args, **kwargs: True
        """)
    )
    env = {k: v for k, v in os.environ.items() if k != "FEDHM_DATA_DIR"}  # the command's --data-dir alone
    env["PYTHONPATH"] = f"{shim}{os.pathsep}{REPO}"
    command = [sys.executable, "-m", "bench.results", "--study", "full_cifar10", "--data-dir", str(folder)]
    shrink = ["--seeds", "0", "--settings", "dir0.5", "--variants", "fedhm", "--rounds", "1", "--jobs", "1"]
    where = ["--runs", str(tmp_path / "runs"), "--page", str(tmp_path / "RESULTS.md"), "--figures", str(tmp_path / "f")]
    done = subprocess.run([*command, *shrink, *where, "--no-readme"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "full_cifar10" / "rounds1" / "dir0.5" / "fedhm" / "seed0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dataset"] == "cifar10" and summary["rounds_completed"] == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["replies"] > 0 and rows[0]["failures"] == 0, done.stderr[-2000:]  # the nodes trained
    # on the main page when the run recorded its deployable accuracy on clean code, else on the archive
    standard = summary.get("code_dirty") is False and "final_deployable_acc/global" in summary
    shown, other = ("RESULTS.md", "RESULTS_ARCHIVE.md") if standard else ("RESULTS_ARCHIVE.md", "RESULTS.md")
    page = (tmp_path / shown).read_text()
    assert "## Study `full_cifar10`" in page and "| full_cifar10 | dir0.5 | fedhm | 0 | grid |" in page
    assert "## Study `full_cifar10`" not in (tmp_path / other).read_text()
