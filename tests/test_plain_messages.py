"""What the commands say is so (#51, "Records and messages"): an existing run directory is refused
with the command that resumes it; a dataset key its dataset lacks is named with the keys it has;
`fedhm summary` / `fedhm compare` print their tables once, in lines a terminal shows; the ETA names
the last round's extra work instead of leaving it out."""

from __future__ import annotations

import io
import json

import pytest
from omegaconf import OmegaConf
from test_statistics import FINAL, _sweep

from fedhm_flwr.config import ConfigError, load_config
from fedhm_flwr.ops.job.progress import FINAL_STATISTICS, Follower, progress_text
from fedhm_flwr.ops.sweeps.multirun import QUIET_SUMMARY_VAR
from fedhm_flwr.ops.sweeps.sweep import SweepSummary
from fedhm_flwr.reporting.results import refuse_existing_run
from fedhm_flwr.reporting.summary import main as summary_main

#: the widest line the console tables may print
WIDTH = 120


def test_an_existing_run_directory_is_refused_with_the_fedhm_resume_command(tmp_path, capsys):
    from fedhm_flwr.ops.cli import main

    run_dir = tmp_path / "my run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match=f"resume it with `fedhm resume '{run_dir}'`"):
        refuse_existing_run(run_dir)
    assert main(["run", "rounds=1", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"`fedhm resume '{run_dir}'`" in err and "launcher --resume" not in err


def test_a_key_the_chosen_dataset_lacks_is_named_with_the_keys_it_has():
    with pytest.raises(ConfigError) as info:
        load_config("dataset.channels=3")
    assert info.value.field == "dataset.channels"
    assert "a key of dataset=fashion_mnist: augment, data_dir, download," in info.value.allowed
    assert "channels is a key of dataset=hf_disk|imagefolder only" in info.value.allowed
    with pytest.raises(ConfigError, match="a key of dataset=cifar10: ") as info:  # the choice before the key
        load_config("dataset=cifar10 dataset.channels=3")
    assert info.value.field == "dataset.channels"
    assert load_config("dataset=imagefolder dataset.path=/x dataset.channels=3").dataset.channels == 3


def test_summary_prints_its_tables_once_in_lines_a_terminal_shows(tmp_path, capsys):
    _sweep(tmp_path / "runs")
    assert summary_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines if str(tmp_path) not in line) <= WIDTH, max(lines, key=len)
    runs = [line for line in lines if line.split()[:1] in (["fedhm"], ["heterofl"]) and "[" not in line]
    assert len(runs) == sum(len(v) for v in FINAL.values())  # one line per run, printed once
    assert len([line for line in lines if line.split()[:1] in (["fedhm"], ["heterofl"])]) == len(runs) + len(FINAL)
    assert "over seeds, final global accuracy:" in out and str(tmp_path / "out" / "summary.md") in out
    wide = (tmp_path / "out" / "summary.md").read_text()  # every column is still in the files
    assert "best_acc/global" in wide and "best_acc/global" not in out


def test_a_comparisons_sweeps_name_their_tables_without_printing_them(tmp_path, capsys, monkeypatch):
    _sweep(tmp_path)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    SweepSummary().on_multirun_end(config)
    alone = capsys.readouterr().out
    monkeypatch.setenv(QUIET_SUMMARY_VAR, "1")
    SweepSummary().on_multirun_end(config)
    quiet = capsys.readouterr().out
    assert "over seeds, final global accuracy:" in alone
    assert max(len(line) for line in alone.splitlines() if str(tmp_path) not in line) <= WIDTH
    assert f"in {tmp_path}/summary.md" in quiet and "final global accuracy" not in quiet and "heterofl" not in quiet


def test_the_eta_names_the_last_rounds_statistics_query_until_it_has_run(tmp_path):
    rows = [{"round": 1, "seconds": 5.0, "acc/global": 0.5}]
    assert "| ETA 0:05 + the final statistics query |" in progress_text(rows, 2, 9.0, 1, last_extra=FINAL_STATISTICS)
    done = [*rows, {"round": 2, "seconds": 5.0, "acc/global": 0.6}]
    assert "| ETA 0:00 |" in progress_text(done, 2, 20.0, 2, last_extra=FINAL_STATISTICS)
    assert "| ETA 0:05 |" in progress_text(rows, 2, 9.0, 1)  # a run without the query: nothing named
    stream = io.StringIO()
    follower = Follower(tmp_path, 2, stream, tty=False, clock=iter([0.0, 9.0]).__next__, last_extra="x")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    follower.poll()
    first, second = stream.getvalue().splitlines()
    assert "ETA 0:05 + x |" in first and "+ x" not in second
