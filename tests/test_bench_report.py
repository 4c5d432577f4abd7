"""The bench's report (bench/run.py, figure 5's section from bench/scale_report.py): a saved
``--scale-clients`` figure appears in every later report with where it came from, the newest size first;
bad figure numbers are refused up front."""

from __future__ import annotations

import json
from statistics import median

import pytest
from data_helpers import needs_fmnist

from bench import run, scale, scale_report


def _run(seconds: list[float]) -> dict:
    return {
        "round_seconds": seconds,
        "server_seconds": [0.1] * len(seconds),
        "queried": [100] * len(seconds),
        "query_seconds": [0.01] * len(seconds),
        "replies": [100] * len(seconds),
        "round1_over_round2": 1.0,
        "max_query_share": 0.01,
        "peak_rss_bytes_process_tree": 3 * 2**30,
        "job_wall_seconds": 60.0,
        "startup_seconds": 4.0,
        "startup_queried": 100,
    }


def _saved(clients: int, ratio: float) -> dict:
    large = {
        "clients": clients,
        "run": {**_run([9.0, 6.0, 6.0]), "round2_over_small_round2": ratio},
        "reference": _run([5.5, 4.5, 4.5]),
        "overrides": ["partition.scheme=iid"],
        "goal": "g",
        "server_state": {
            "note": "n",
            "bytes_per_node": 321.0,
            "rows": {"1000": {"server_state_bytes": 2**20, "bytes_per_known_node": 1048.6}},
        },
    }
    figure = {
        "clients": 1000,
        "per_round": 100,
        "rounds": 3,
        "runs": {"sampled": _run([5.0, 4.0, 4.0])},
        "goal": "g",
        "large": large,
    }
    return {
        "machine": "m",
        "commit": "abc1234",
        "date": "2026-01-01 00:00 UTC",
        "command": f"python -m bench.run --only 5 --scale-clients {clients}",
        "figure": figure,
    }


def test_the_newest_largest_saved_figure_reaches_every_report(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "SCALE_DIR", tmp_path)
    assert scale.load_large() is None
    for clients, ratio in ((2000, 1.11), (10000, 1.37)):  # 10000 sorts before 2000 as text
        (tmp_path / f"scale-{clients}.json").write_text(json.dumps(_saved(clients, ratio)))
    figure = {k: v for k, v in _saved(10000, 0.0)["figure"].items() if k != "large"}
    figure["large_saved"] = scale.load_large()
    text = run.markdown({"machine": "here", "figures": {"5_scale": figure}})
    assert "### 10,000 simulated clients" in text and "**1.37**" in text and "1.11" not in text
    assert "`bench/scale/scale-10000.json`" in text and "abc1234" in text and "--scale-clients 10000" in text
    assert "**321 bytes per node**" in text and "5.5 s, 4.5 s, 4.5 s" in text  # the reference's rounds


def test_save_writes_the_figure_and_its_section(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "SCALE_DIR", tmp_path)
    saved = _saved(3000, 1.2)
    path = scale.save_large(saved["figure"], 3000)
    assert json.loads(path.read_text())["figure"] == saved["figure"]
    assert "**1.20**" in path.with_suffix(".md").read_text()


@pytest.mark.parametrize(
    "argv, needle", [(["--only", "1,99"], "--only"), (["--scale-clients", "50"], "--scale-clients")]
)
def test_bad_arguments_are_refused_before_any_figure(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(run, "FIGURES", {k: (n, _fail, md) for k, (n, _, md) in run.FIGURES.items()})
    with pytest.raises(SystemExit):
        run.main(argv)
    assert needle in capsys.readouterr().err


def _fail(*args, **kwargs):
    raise AssertionError("a figure ran despite a bad argument")


@needs_fmnist
def test_the_project_alone_runs_each_node_count_in_process_and_reports_their_ratio():
    """Figure 5's in-process check (no Flower engine): one job per node count, every round kept, and
    the report's ratio is the median of the later rounds at the largest count over the smallest's."""
    alone = scale.project_alone((20, 60), per_round=4, rounds=3)
    rows = alone["rows"]
    assert set(rows) == {"20", "60"} and all(len(r["round_seconds"]) == 3 for r in rows.values())
    expected = median(rows["60"]["round_seconds"][1:]) / median(rows["20"]["round_seconds"][1:])
    assert alone["later_rounds_ratio"] == pytest.approx(expected)
    (line,) = scale_report.project_alone_markdown(alone)
    assert " at 20 nodes" in line and " at 60;" in line and f"**{expected:.2f}**" in line


def test_the_whole_job_breakdown_adds_up_to_the_jobs_wall_time_and_reaches_the_report():
    from bench.whole_job import job_breakdown

    marks = {
        "launcher_started_at": 102.0,
        "checked_at": 103.0,
        "superlink_ready_at": 105.0,
        "app_staged_at": 105.5,
        "run_started_at": 108.0,
        "flwr_run_exited_at": 160.0,
        "status_checked_at": 161.0,
        "cleaned_up_at": 162.0,
    }
    summary = {"started_at": 112.0, "startup_seconds": 6.0, "rounds_started_at": 120.0, "finished_at": 158.0}
    rows = [
        {
            "round": r,
            "seconds": 17.0,
            "server_seconds": 1.0,
            "train_seconds": 10.0,
            "client_seconds_sum": 16.0,
            "replies": 4,
            "eval_seconds": 5.0,
            "deploy_stats_seconds": 0.5 * (r == 2),
        }
        for r in (1, 2)
    ]
    b = job_breakdown(100.0, 163.0, marks, summary, rows, workers=2)
    assert b["wall_seconds"] == 63.0
    assert b["startup_seconds"] + b["rounds_seconds"] + b["end_seconds"] == pytest.approx(63.0)
    assert b["startup_seconds"] == pytest.approx(20.0)  # process start to round 1
    assert b["rounds"]["client training (clients' own seconds ÷ parallel workers)"] == pytest.approx(16.0)
    assert b["rounds"]["messaging and client set-up (rest of push → last reply)"] == pytest.approx(4.0)
    assert b["startup"]["ServerApp set-up (test set, model)"] == pytest.approx(2.0)
    job = {
        "overrides": [],
        "clients": 20,
        "per_round": 10,
        "rounds": 2,
        "workers": 2,
        "job": b,
        "job_final_accuracy": 0.5,
        "ratio": 1.26,
        "target": 1.3,
        "bare": {
            "wall_seconds": 50.0,
            "process start and imports": 1.0,
            "data load and model": 1.0,
            "client training": 30.0,
            "server (SVD cuts, multiply back, average)": 1.0,
            "evaluation (global + levels)": 16.0,
            "process exit": 1.0,
            "final_accuracy": 0.5,
        },
    }
    sweep = {
        "overrides": ["rounds=2", "seed=0,1"],
        "identical_final_models": True,
        "sweeps": {
            "one shared Ray instance": {
                "sweep_seconds": 40.0,
                "jobs": [
                    {"job_seconds": 18.0, "startup_seconds": 8.0, "superlink_seconds": 0.0, "node_queries_seconds": 1.0}
                ]
                * 2,
            }
        },
    }
    text = run.markdown({"machine": "here", "figures": {"8_whole_job": {"jobs": {"default": job}, "sweep": sweep}}})
    assert "**1.26**" in text and "| **total** | **63.00** | **50.00** |" in text and "bit for bit: **yes**" in text
    assert "| **1.26** | **1.00** |" in text  # both rounds took 17 s: the last one is the median


def test_the_last_round_is_measured_against_the_median_round():
    from bench.whole_job import last_round_ratio

    rounds = [{"seconds": s} for s in (10.0, 12.0, 11.0, 30.0)]
    assert last_round_ratio(rounds) == pytest.approx(30.0 / 11.5)
    assert last_round_ratio([{"seconds": 9.0}, {"seconds": 10.0}, {"seconds": 9.0}]) == pytest.approx(1.0)


def test_the_server_figures_echo_clients_are_accepted_so_aggregation_is_what_is_timed():
    """Figure 1 times configure + aggregate on echoed replies: a reply the server refuses would time
    the keep-the-old-model path instead of the aggregation."""
    from flwr.app import ArrayRecord, MessageType

    from bench.common import echo, identity_query
    from fedhm_flwr.config import load_config, model_spec, run_options
    from fedhm_flwr.ops.apps.local_grid import LocalGrid
    from fedhm_flwr.ops.apps.server_app import initial_state
    from fedhm_flwr.server.registry import STRATEGIES

    for method in ("fedhm", "fedavg"):
        cfg = load_config(f"method={method} model.width=4 num_clients=4 fraction_train=1.0")
        spec = model_spec(cfg)
        strategy = STRATEGIES[method](run_options(cfg), spec)
        grid = LocalGrid(4, {MessageType.TRAIN: echo, MessageType.QUERY: identity_query})
        arrays = ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, spec))
        replies = grid.send_and_receive(list(strategy.configure_train(1, arrays, None, grid)))
        _, metrics = strategy.aggregate_train(1, replies)
        assert strategy.round_log.rejected == [] and metrics["replies"] == 4


def test_the_sweeps_final_models_are_compared_by_tensor_not_by_file_bytes(tmp_path):
    """A checkpoint's metadata holds the run's history (wall times): equal tensors in files that differ are the same
    model; one changed bit is not."""
    import torch
    from safetensors.torch import save_file

    from bench.whole_job import same_tensors

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(state, tmp_path / "a.safetensors", metadata={"history": '{"seconds": 1.5}'})
    save_file(state, tmp_path / "b.safetensors", metadata={"history": '{"seconds": 2.5}'})
    assert (tmp_path / "a.safetensors").read_bytes() != (tmp_path / "b.safetensors").read_bytes()
    assert same_tensors(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    other = {"w": state["w"].clone()}
    other["w"][1, 2] = torch.nextafter(other["w"][1, 2], torch.tensor(100.0))
    save_file(other, tmp_path / "c.safetensors")
    assert not same_tensors(tmp_path / "a.safetensors", tmp_path / "c.safetensors")


def test_the_statistics_sample_figure_reports_each_levels_gap_and_voids_itself_when_models_differ():
    """Figure 9: the gaps are the largest per-level accuracy differences in points, over the models
    both settings scored; the section says the figure is void when the runs' final models differ."""
    from bench.deploy_sample import BEFORE, REFERENCE, deploy_sample_markdown, max_gap

    ref = {"global": 0.8348, "level_0.5": 0.8329, "level_0.125": 0.8217}
    new = {"global": 0.8366, "level_0.5": 0.8338, "level_0.125": 0.8204, "level_0.25": 0.5}
    assert max_gap(new, ref) == pytest.approx(0.18)  # level_0.25 is not in both: not compared
    assert max_gap(ref, ref) == 0.0

    def setting(acc, seconds):
        return {
            "overrides": ["rounds=2", "evaluation.bn_clients=0"],
            "query_past_evaluation_seconds": seconds,
            "last_round_ratio": 1.2,
            "deployable_acc": acc,
            "gap_to_reference_points": max_gap(acc, ref),
            "gap_to_before_points": max_gap(acc, ref),
        }

    figure = {"base": ["rounds=2"], "same_final_models": True, "settings": {REFERENCE: setting(ref, 9.5)}}
    figure["settings"][BEFORE] = setting(new, 1.25)
    text = "\n".join(deploy_sample_markdown(figure))
    assert "| previous default | `evaluation.bn_clients=0` | 1.25 | 1.20 | 0.8366 | 0.8204 | 0.8338 | 0.18 |" in text
    assert "the same, tensor by tensor" in text and "void" not in text
    assert "void" in "\n".join(deploy_sample_markdown({**figure, "same_final_models": False}))
