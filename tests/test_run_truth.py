"""Every run ends with the truth (#51): data its nodes cannot learn from is refused before anything
starts, computed as the nodes compute their partitions; a run in which no node trained in some round
ends as a failure (``error: the run ended, but ...``, exit 1, ``fedhm status`` failed); and a run records
the commit of the clone its app was staged from, wherever its run directory lies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
from flwr.app import Context, RecordDict
from PIL import Image

from fedhm_flwr.config import ConfigError
from fedhm_flwr.data.clients import client_size
from fedhm_flwr.data.sources import check_partitions, partition_indices
from fedhm_flwr.data.spec import make_data_spec
from fedhm_flwr.ops.apps import server_app
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.job.health import final_line, judge
from fedhm_flwr.ops.job.status import run_status
from fedhm_flwr.ops.job.superlink import stage_app
from fedhm_flwr.reporting import provenance

ROOT = Path(__file__).resolve().parents[1]
FEDHM = [sys.executable, "-m", "fedhm_flwr"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _fedhm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDHM, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _image_folder(root: Path, classes: list[str], per_class: int = 6) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * c, 10 * i, 0)).save(root / name / f"{i}.png")
    return root


# --------------------------------------------------------------------------- refused before start


def test_a_partition_the_nodes_cannot_make_is_refused_and_the_count_offered_partitions():
    spec = make_data_spec("fashion_mnist", 20, scheme="dirichlet", max_train_examples=40)
    with pytest.raises(ValueError):  # what every simulated node hits at its node-info query
        client_size(spec, 0)
    with pytest.raises(ConfigError) as info:
        check_partitions(spec)
    assert info.value.field == "num_clients" and info.value.value == 20
    said = str(info.value)
    assert "dataset.max_train_examples" in said and "partition.alpha" in said, said
    offered = int(re.search(r"num_clients=(\d+) can", said).group(1))
    assert 1 <= offered < 20
    parts = partition_indices({**spec, "num_partitions": offered})  # the nodes' own partitioning
    assert len(parts) == offered and min(len(p) for p in parts) >= 2
    assert len(np.unique(np.concatenate(parts))) == 40


def test_the_borderline_partition_is_accepted_and_really_partitions():
    """IID: 40 examples make 40 one-example partitions, not 41."""
    spec = make_data_spec("fashion_mnist", 40, scheme="iid", max_train_examples=40)
    check_partitions(spec)
    parts = partition_indices(spec)
    assert [len(p) for p in parts] == [1] * 40 and all(client_size(spec, pid) == 1 for pid in (0, 39))
    with pytest.raises(ConfigError, match=r"num_clients=41; .*num_clients=40 can"):
        check_partitions({**spec, "num_partitions": 41})


def test_data_of_one_class_is_refused_two_are_accepted(tmp_path):
    one = _image_folder(tmp_path / "one", ["cats"])
    spec = make_data_spec("imagefolder", 2, path=str(one), scheme="iid")
    with pytest.raises(ConfigError, match=r"at least 2 classes .*it holds 1 \['cats'\]") as info:
        check_partitions(spec)
    assert info.value.field == "dataset.path"
    two = _image_folder(tmp_path / "two", ["cats", "dogs"])
    check_partitions({**spec, "path": str(two)})


def test_the_text_dataset_is_checked_before_start_as_image_data_is(monkeypatch):
    from fedhm_flwr.data import sources, text

    spec = make_data_spec("sentiment", 4, scheme="iid")
    check_partitions(spec)  # the corpus's two classes, four partitions: accepted
    labels = sources.split_labels("sentiment", "train")
    assert sorted(np.unique(labels)) == [0, 1] and len(text.partition_indices(spec)) == 4
    # partitions the nodes cannot make (computed as the nodes compute theirs) are refused
    with pytest.raises(ConfigError, match=r"num_clients=20; .*computed as the nodes do"):
        check_partitions(make_data_spec("sentiment", 20, scheme="dirichlet", max_train_examples=40))
    # a training split of one class is refused, naming the dataset and the class it holds
    monkeypatch.setattr(sources, "split_labels", lambda name, split: np.zeros_like(labels))
    with pytest.raises(ConfigError, match=r"at least 2 classes .*it holds 1 \['negative'\]") as info:
        check_partitions(spec)
    assert info.value.field == "dataset.name"


@pytest.mark.parametrize(
    "case, says",
    [
        (["dataset.max_train_examples=40", "num_clients=20", "rounds=1"], "invalid config: num_clients=20; "),
        (["dataset=imagefolder", "rounds=1"], "invalid config: dataset.path="),
    ],
)
def test_fedhm_run_refuses_them_in_one_line_before_anything_starts(tmp_path, case, says):
    if "dataset=imagefolder" in case:
        case = [*case, f"dataset.path={_image_folder(tmp_path / 'one', ['cats'])}"]
    run_dir = tmp_path / "run"
    proc = _fedhm("run", *case, "--run-dir", str(run_dir))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(f"error: {says}")
    assert proc.stdout == "" and not run_dir.exists()  # nothing started, nothing written
    status = _fedhm("status", str(run_dir))
    assert status.returncode == 2 and "not a run directory" in status.stderr


def test_fedhm_deploy_local_refuses_partitions_its_nodes_cannot_make_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    case = ["--nodes", "20", "dataset.max_train_examples=40", "rounds=1"]
    proc = _fedhm("deploy-local", *case, "--run-dir", str(run_dir))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: invalid config: num_clients=20; "), proc.stderr
    assert "computed as the nodes do" in proc.stderr
    assert "SuperLink" not in proc.stdout and not run_dir.exists()  # no credentials, no process, nothing written


# --------------------------------------------------------------------------- judged after the end


def _rows(tmp_path: Path, rows: list[dict], extra: str = "") -> dict:
    from omegaconf import OmegaConf

    from fedhm_flwr.config import load_config

    OmegaConf.save(load_config(extra), tmp_path / "config.yaml")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"final_acc/global": 0.5, "output_dir": str(tmp_path)}


def test_a_round_in_which_no_node_trained_fails_the_run_naming_the_first_client_error(tmp_path):
    wrapped = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()\n"
        '  File "x.py", line 1, in run\nValueError: inner\n\nflwr.clientapp.client_app.ClientAppException: \n'
        "Exception ClientAppException occurred. Message: partition.alpha=0.5 could not give each of 3 "
        "partitions at least 2 of 4 examples'>"
    )
    trained = {"round": 1, "sampled": 3, "replies": 3, "failures": 0, "rejected": 0, "acc/global": 0.5}
    idle = {"round": 2, "sampled": 0, "replies": 0, "failures": 0, "rejected": 0, "acc/global": 0.5}
    summary = _rows(tmp_path, [trained, {**idle, "excluded": json.dumps({"n1": wrapped, "n2": wrapped})}])
    code, line = final_line(summary)
    assert code == 1 and line.startswith(
        "error: the run ended, but no node trained in round 2 (0 sampled; 2 sat out after a failed "
        "node-info query), so the global model was not updated there; the first client error: "
        "partition.alpha=0.5 could not give each of 3 partitions at least 2 of 4 examples;"
    ), line
    # a round whose sampled nodes all failed or were late: the same, with the failure's own line
    crashed = json.dumps([["p1", "boom\nOSError: disk"]])
    late = {**idle, "sampled": 2, "failures": 1, "late": 1, "failure_reasons": crashed}
    _rows(tmp_path, [trained, late])
    assert judge(tmp_path).problem.startswith("no node trained in round 2 (2 sampled, 1 failed, 1 late)")
    assert judge(tmp_path).problem.endswith("the first client error: OSError: disk")
    # under an attack, a round whose replies were all refused is the defence's doing
    refused = {**idle, "sampled": 2, "rejected": 2, "failure_reasons": json.dumps([["p1", "norm above the bound"]] * 2)}
    _rows(tmp_path, [trained, refused], "failures.attack.kind=scale failures.attack.fraction=0.5")
    assert judge(tmp_path).fatal is False
    # a round that asked no node (a DP round's Poisson sample may be empty) is no failure of the nodes
    _rows(tmp_path, [trained, idle, {**trained, "round": 3}])
    assert judge(tmp_path).fatal is False


def test_the_serverapp_records_a_run_without_training_as_failed(toy_cfg, tmp_path):
    """Every sampled node crashes: the run ends, status.json says failed with the error line's cause."""
    cfg = toy_cfg("rounds=1 num_clients=2 failures.crash_probability=1.0 evaluation.levels=false")
    run_dir = tmp_path / "run"
    summary = server_app.run(LocalGrid(2, client_handlers()), cfg, run_dir)
    code, line = final_line(summary)
    status = json.loads((run_dir / "status.json").read_text())
    assert code == 1 and status["status"] == "failed" and line == f"error: {status['error']}; outputs in {run_dir}"
    assert status["error"].startswith("the run ended, but no reply of the whole run was accepted (2 failed")
    assert "the first client error: " in status["error"]
    said = f"{run_dir}: failed after 1/1 rounds; last checkpoint: round 1: {status['error']}"
    assert run_status(run_dir) == (1, said)


@pytest.mark.slow
def test_fedhm_run_of_a_run_in_which_nothing_trained_ends_with_exit_1_and_status_failed(tmp_path):
    run_dir = tmp_path / "run"
    proc = _fedhm(
        "run",
        "rounds=1",
        "num_clients=2",
        "failures.crash_probability=1.0",
        "dataset.max_train_examples=200",
        "dataset.max_test_examples=100",
        "model.width=4",
        "evaluation.levels=false",
        "--run-dir",
        str(run_dir),
        timeout=600,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert errors == [proc.stderr.strip().splitlines()[-1]] and errors[0].startswith("error: the run ended, but ")
    assert "the first client error: " in errors[0] and "run complete" not in proc.stdout
    status = _fedhm("status", str(run_dir))
    assert status.returncode == 1 and f"{run_dir}: failed after 1/1 rounds" in status.stderr
    assert "the run ended, but no reply of the whole run was accepted" in status.stderr


# --------------------------------------------------------------------------- the code a run was built from


def test_the_staged_app_carries_the_clones_commit_and_a_run_outside_the_clone_records_it(
    toy_cfg, tmp_path, monkeypatch
):
    app = stage_app(tmp_path / "app")
    config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    head = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--", *provenance.CODE_PATHS))
    assert config[provenance.COMMIT_KEY] == head and config[provenance.DIRTY_KEY] == str(dirty).lower()
    clone = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert clone[provenance.COMMIT_KEY] == ""  # the clone's own: the ServerApp asks git
    # the ServerApp as Flower runs it: from an installed copy outside any checkout, into a run
    # directory outside the clone, with the staged app's run config
    monkeypatch.setattr(provenance, "ROOT", tmp_path / "installed")
    monkeypatch.setattr(server_app, "code_version", lambda: provenance.code_version(tmp_path / "installed"))
    monkeypatch.setattr(server_app, "load_config", lambda overrides: toy_cfg(f"rounds=1 {overrides}"))
    run_dir = tmp_path / "runs" / "r1"
    run_config = {**config, "overrides": "num_clients=2 evaluation.levels=false", "output-dir": str(run_dir)}
    server_app.main(LocalGrid(2, client_handlers()), Context(1, 0, {}, RecordDict(), run_config))
    status = json.loads((run_dir / "status.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert status["status"] == "completed" and status["code_commit"] == summary["code_commit"] == head
    assert summary["code_dirty"] is dirty
