"""How a finished run ends, judged from what it recorded: collapsed (said in the last line),
diverged or without one accepted reply (exit 1 with a hint); and `fedhm resume` of a folder that
is not a run."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from fedhm_flwr.config import ConfigError, load_config
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.ops.job.health import final_line, judge
from fedhm_flwr.ops.job.outcome import require_checkpoint


def _row(round_: int, **values) -> dict:
    row = {
        "round": round_,
        "sampled": 4,
        "replies": 4,
        "failures": 0,
        "rejected": 0,
        "train_loss": 1.0,
        "acc/global": 0.6,
        "loss/global": 1.1,
    }
    row.update(values)
    return {k: v for k, v in row.items() if v is not ...}


def _run_dir(tmp_path, rows, overrides: str = "dataset=cifar10 train.lr=0.05"):
    OmegaConf.save(load_config(overrides), tmp_path / "config.yaml")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"final_acc/global": rows[-1].get("acc/global"), "output_dir": str(tmp_path)}


def test_a_healthy_run_ends_with_its_plain_line(tmp_path):
    summary = _run_dir(tmp_path, [_row(1), _row(2, **{"acc/global": 0.7})])
    assert final_line(summary) == (0, f"run complete: final global accuracy 0.7000; outputs in {tmp_path}")


@pytest.mark.parametrize(
    "last, said",
    [
        ({"acc/global": 0.2, "loss/global": math.log(10)}, "its test loss 2.3026 is ln 10"),
        ({"acc/global": 0.1, "loss/global": 3.9}, "its accuracy 0.1000 is chance for 10 classes"),
    ],
)
def test_a_collapsed_model_is_said_in_the_last_line(tmp_path, last, said):
    summary = _run_dir(tmp_path, [_row(1), _row(2, **last)])
    code, line = final_line(summary)
    assert code == 0 and line.startswith("run complete: final global accuracy") and f"outputs in {tmp_path}" in line
    assert "but the model collapsed: " in line and said in line and "train.lr" in line


def test_a_diverged_model_ends_with_exit_1_and_a_hint(tmp_path):
    nan = json.dumps([["p1", "train-loss is not finite (nan)"], ["p2", "conv1.weight holds NaN or Inf"]])
    rows = [_row(1), _row(2, replies=0, rejected=2, train_loss=..., failure_reasons=nan)]
    code, line = final_line(_run_dir(tmp_path, rows))
    assert code == 1 and line.startswith(
        "error: the run ended, but the model diverged: every reply of round 2 (2) "
        "was refused as non-finite or oversized (train-loss is not finite (nan))"
    )
    assert "lower train.lr (it is 0.05; e.g. train.lr=0.0125) or clip gradients" in line
    # a loss recorded as not finite (metrics.jsonl writes NaN as null)
    _run_dir(tmp_path, [_row(1, **{"loss/global": None})])
    assert judge(tmp_path).problem.startswith("the model diverged: loss/global is not finite in round 1")
    # refusals of another kind in a round do not say divergence (but that no node trained there);
    # under an attack refusals are expected
    other = json.dumps([["p1", "num-examples 900 exceeds the 30 training examples"]])
    _run_dir(tmp_path, [_row(1), _row(2, replies=0, rejected=1, failure_reasons=other)])
    assert judge(tmp_path).problem.startswith("no node trained in round 2 (4 sampled, 1 refused)")
    attacked = _run_dir(tmp_path, rows, "dataset=cifar10 failures.attack.kind=malformed failures.attack.fraction=0.5")
    assert final_line(attacked)[0] == 0


def test_a_run_without_one_accepted_reply_ends_with_exit_1(tmp_path):
    crashed = json.dumps([["p1", "ClientAppException: boom"]])
    rows = [_row(r, replies=0, failures=4, train_loss=..., failure_reasons=crashed) for r in (1, 2)]
    code, line = final_line(_run_dir(tmp_path, rows))
    assert code == 1 and "no reply of the whole run was accepted (8 failed or refused" in line


def test_a_real_run_that_diverges_ends_with_exit_1(toy_cfg, tmp_path):
    """A learning rate of 1e6 on the toy CNN: every client's loss is NaN, every reply is refused."""
    cfg = toy_cfg("rounds=1 num_clients=2 dataset.max_train_examples=200 train.lr=1e6 evaluation.levels=false")
    summary = run(LocalGrid(2, client_handlers()), cfg, tmp_path / "run")
    code, line = final_line(summary)
    assert code == 1 and "the model diverged" in line and "train.lr" in line, line


def test_resume_of_a_folder_that_is_not_a_run_says_so(tmp_path):
    with pytest.raises(ConfigError, match="this folder is not a run") as info:
        require_checkpoint(tmp_path)
    assert info.value.field == "resume"
    with pytest.raises(ConfigError, match="this folder does not exist"):
        require_checkpoint(tmp_path / "missing")
    (tmp_path / "config.yaml").write_text("rounds: 2\n")  # a run that stopped before its first checkpoint
    with pytest.raises(ConfigError, match="holds none: the run stopped before its first one"):
        require_checkpoint(tmp_path)


def test_fedhm_resume_of_a_folder_that_is_not_a_run_exits_2(tmp_path, capsys):
    from fedhm_flwr.ops.cli import main

    assert main(["resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"resume='{tmp_path}'" in err and "this folder is not a run" in err and "before its first" not in err
