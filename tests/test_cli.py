"""The `fedhm` command, the Python API and the progress line."""

from __future__ import annotations

import datetime as dt
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhm_flwr import api
from fedhm_flwr.config import ConfigError
from fedhm_flwr.ops.cli import COMMANDS, compare_plan, main
from fedhm_flwr.ops.job.progress import Follower, eta_seconds, format_seconds, progress_text

SUBCOMMANDS = [
    "run",
    "resume",
    "sweep",
    "compare",
    "status",
    "deploy-local",
    "stage",
    "inspect",
    "summary",
    "shards",
    "supernode",
    "superlink",
    "export",
    "bench",
]

# a recorded metrics.jsonl (the columns the progress line reads, as a run writes them)
RECORDED = [
    {"round": 1, "acc/global": 0.41, "failures": 0, "rejected": 0, "seconds": 9.0, "bytes_sent": 100},
    {"round": 2, "failures": 1, "rejected": 0, "seconds": 10.0, "bytes_sent": 100},  # not evaluated this round
    {"round": 3, "acc/global": 0.6234, "failures": 0, "rejected": 1, "seconds": 11.0, "bytes_sent": 100},
]


def test_help_lists_every_subcommand_each_with_an_example(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert list(COMMANDS) == SUBCOMMANDS
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in top and f"e.g. fedhm {name}" in top
        code = main([name, "--help"])
        out = capsys.readouterr().out
        assert code == 0, name
        assert f"examples:\n  fedhm {name}" in out, name


def test_unknown_subcommand_is_refused_naming_the_allowed_ones(capsys):
    assert main(["train"]) == 2
    assert "unknown command 'train'; allowed: ['run', 'resume', 'sweep'" in capsys.readouterr().err


def test_stage_ships_the_app_alone_and_refuses_a_destination_it_would_wreck(tmp_path, capsys):
    """`fedhm stage DEST` (docs/DEPLOY.md's `flwr run` step): the app's packages, conf/ and pyproject
    in DEST, named alone on stdout; none of tests/, docs/, results/; the bundle Flower builds of it a
    fraction of the checkout's. A DEST it would empty or copy into itself is refused, untouched."""
    from flwr.cli.build import build_fab_from_disk

    root = Path(__file__).resolve().parents[1]
    dest = tmp_path / "app"
    assert main(["stage", str(dest)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{dest}\n"
    staged = {p.name for p in dest.iterdir()}
    assert {"fedhm_flwr", "strategies", "clients", "conf", "pyproject.toml"} <= staged
    assert not staged & {"tests", "docs", "results", "bench", "scripts", "outputs", ".venv", "Makefile"}
    assert (dest / "conf" / "config.yaml").is_file() and (
        dest / "fedhm_flwr" / "ops" / "apps" / "server_app.py"
    ).is_file()
    assert not list(dest.rglob("__pycache__"))
    shipped, whole = len(build_fab_from_disk(dest)), len(build_fab_from_disk(root))  # what `flwr run` sends
    assert f"({shipped} bytes)" in err and shipped < whole / 3, (shipped, whole)
    (dest / "fedhm_flwr" / "stale.py").write_text("")
    assert main(["stage", str(dest)]) == 0 and not (dest / "fedhm_flwr" / "stale.py").exists()  # replaced
    capsys.readouterr()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "a-file").write_text("keep")
    for bad, says in (
        (tmp_path / "mine", "holds other files (notes.txt)"),
        (tmp_path / "a-file", "is a file"),
        (root / "fedhm_flwr" / "x", "lies in the app's own files"),
        (root, "the checkout"),
        (root.parent, "the checkout or a folder above it"),
    ):
        assert main(["stage", str(bad)]) == 2, bad
        assert f"error: DEST {bad} " in (err := capsys.readouterr().err) and says in err, err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep" and not (root / "fedhm_flwr" / "x").exists()


def test_run_refuses_a_bad_value_before_starting_anything(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "partition.scheme=shards", "--run-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "partition.scheme" in err and "'dirichlet'" in err
    assert not out.exists()
    assert main(["resume", str(tmp_path / "none")]) == 2
    assert "invalid config: resume=" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="rounds"):
        api.run(["rounds=0"], run_dir=tmp_path / "api")
    assert not (tmp_path / "api").exists()


def test_inspect_example_runs_and_prints_one_row_per_level(capsys):
    assert main(COMMANDS["inspect"].examples[1].split()[1:]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["ratio"] for r in rows] == [1.0, 0.5, 0.25]
    assert rows[0]["params"] > rows[1]["params"] > rows[2]["params"] > 0


def test_python_m_alias_and_module_paths_stay(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fedhm_flwr", "export", f"run={tmp_path}", "level=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid config: run=" in proc.stderr


def test_sweep_reaches_hydra_and_its_config_tree(tmp_path, capfd):
    """`fedhm sweep` runs the Hydra app (config tree found, jobs validated before anything starts)."""
    code = main(["sweep", "partition.scheme=bogus", "rounds=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    err = capfd.readouterr().err
    assert code != 0 and "invalid config: partition.scheme='bogus'" in err
    assert not list((tmp_path / "sweep").rglob("metrics.jsonl"))


def test_compare_plan_runs_every_method_on_every_seed_then_each_ablation():
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    root, sweeps = compare_plan([], now=now)
    assert root == "outputs/compare/2026-01-02_03-04-05"
    common = ["seed=0,1,2", "levels.match=fedhm_params", "rounds=8", "dataset.max_train_examples=30000"]
    assert sweeps[0] == [
        "method=fedhm,heterofl,fedrolex,fedavg,fedavg_smallest",
        *common,
        f"hydra.sweep.dir={root}/methods",
    ]
    assert sweeps[1:] == [
        ["method=fedhm", option, *common, f"hydra.sweep.dir={root}/{option.split('=')[0]}"]
        for option in ("train.distill.enabled=true", "method.official_weights=true", "method.add_previous_global=true")
    ]
    # the user's overrides replace the defaults with the same key, directory and methods included
    root, sweeps = compare_plan(["rounds=2", "method=fedhm,heterofl", "hydra.sweep.dir=/tmp/c"], "1", "none", (), now)
    assert root == "/tmp/c"
    assert sweeps == [
        [
            "method=fedhm,heterofl",
            "seed=1",
            "levels.match=none",
            "dataset.max_train_examples=30000",
            "rounds=2",
            "hydra.sweep.dir=/tmp/c/methods",
        ]
    ]


def test_compare_match_names_the_resource_and_refuses_others(capsys):
    from fedhm_flwr.ops.sweeps.multirun import match_option

    assert [match_option(v) for v in ("params", "macs", "memory", "fedhm_memory", "none")] == [
        "fedhm_params",
        "fedhm_macs",
        "fedhm_memory",
        "fedhm_memory",
        "none",
    ]
    assert main(["compare", "--match", "flops", "--seeds", "0"]) == 2
    assert "'flops'; allowed: params, macs, memory, none" in capsys.readouterr().err


def test_api_summary_reads_a_finished_run(tmp_path):
    summary = {
        "output_dir": str(tmp_path),
        "final_acc/global": 0.7,
        "final_acc/level_0.5": 0.6,
        "final_acc/level_0.125": 0.4,
        "best_acc/level_0.5": 0.65,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    result = api.load(tmp_path)
    assert result.final_accuracy == 0.7 and result.run_dir == tmp_path
    assert result.level_accuracy == {"0.5": 0.6, "0.125": 0.4}
    with pytest.raises(FileNotFoundError):
        api.load(tmp_path / "none")


def test_eta_arithmetic():
    assert eta_seconds(30.0, 3, 7) == 70.0  # 10 s per round, 7 rounds left
    assert eta_seconds(30.0, 0, 7) is None and eta_seconds(12.0, 4, 0) == 0.0
    # from the second round on, the pace leaves out the start-up: 20 s for rounds 2-3 -> 10 s a round
    assert eta_seconds(50.0, 3, 7, since_first=20.0) == 70.0 and eta_seconds(50.0, 1, 7, since_first=0.0) == 350.0
    # after one round: that round's own time, not the start-up before it
    assert eta_seconds(50.0, 1, 7, since_first=0.0, round_seconds=5.0) == 35.0
    assert [format_seconds(s) for s in (None, 0, 59.6, 61, 3725)] == ["?", "0:00", "1:00", "1:01", "1:02:05"]


def test_plain_mode_prints_one_line_per_recorded_round(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    now = [100.0]
    stream = io.StringIO()
    follower = Follower(tmp_path, total=5, stream=stream, tty=False, label="job 0: ", clock=lambda: now[0])
    follower.poll()
    assert stream.getvalue() == ""  # nothing recorded yet: nothing printed
    metrics.write_text(json.dumps(RECORDED[0]) + "\n")
    now[0] = 120.0
    follower.poll()
    follower.poll()  # no new round: no new line
    metrics.write_text("".join(json.dumps(r) + "\n" for r in RECORDED))
    now[0] = 160.0
    follower.poll()
    assert stream.getvalue().splitlines() == [
        "job 0: round 1/5 | elapsed 0:20 | ETA 0:36 | acc 0.4100 | failures 0",  # round 1's own 9 s x 4 left
        "job 0: round 2/5 | elapsed 1:00 | ETA 2:00 | acc 0.4100 | failures 1",
        "job 0: round 3/5 | elapsed 1:00 | ETA 0:40 | acc 0.6234 | failures 2",
    ]


def test_a_resume_shows_the_round_past_its_checkpoint_again_not_the_stopped_sessions_row(tmp_path):
    # a session stopped between round 3's row and round 3's checkpoint: 3 rows, checkpoint at round 2
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in RECORDED[:3]))
    stream = io.StringIO()
    follower = Follower(tmp_path, total=5, stream=stream, tty=False, clock=lambda: 10.0, done=2)
    follower.poll()
    assert stream.getvalue() == ""  # the stopped session's round 3 is not this session's
    metrics.write_text("".join(json.dumps(r) + "\n" for r in RECORDED[:2]))  # the resume rewrites the rows
    follower.poll()
    again = {**RECORDED[2], "acc/global": 0.5}
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [*RECORDED[:2], again]))
    follower.poll()
    assert [line.split(" | ")[0] for line in stream.getvalue().splitlines()] == ["round 3/5"]
    assert "acc 0.5000" in stream.getvalue()


def test_resumed_run_counts_only_this_sessions_rounds_and_terminal_mode_rewrites_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDED[:2]))
    now = [0.0]
    stream = io.StringIO()
    follower = Follower(tmp_path, total=4, stream=stream, tty=True, clock=lambda: now[0])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDED))
    now[0] = 12.0
    follower.poll()
    # one round done in this session (its own wall time 11 s, of the 12 s elapsed), one left
    assert stream.getvalue() == "\rround 3/4 | elapsed 0:12 | ETA 0:11 | acc 0.6234 | failures 2\x1b[K"
    assert "\n" not in stream.getvalue()
    assert progress_text([], 4, 0.0, 0) == "round 0/4 | elapsed 0:00 | ETA ? | acc - | failures 0"


# `fedhm run` through the launcher (progress lines, TensorBoard events every round): one of the
# end-to-end runs of tests/test_end_to_end.py
