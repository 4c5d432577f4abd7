"""The run's deployable accuracy (summary.json ``final_deployable_acc/<global|level_γ>``): each model
scored with the statistics its export carries, equal to what `fedhm export` measures; and the code a
run starts with (``code_commit``, ``code_dirty``). In-process runs of the toy job (seconds each)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.ops.tools.export import export_level
from fedhm_flwr.reporting.provenance import ROOT, code_version, version_label
from fedhm_flwr.reporting.results import load_bn_statistics, read_status

LEVELS = (1, 0.5, 0.25, 0.125)


def _run(cfg, out: Path) -> tuple[dict, list[dict]]:
    run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows


def test_every_levels_deployable_accuracy_is_what_its_export_scores(toy_cfg, tmp_path):
    summary, rows = _run(toy_cfg("rounds=1"), tmp_path / "run")
    assert summary["bn_stats"] == "test_batch" and summary["deployable_bn_stats"] == "federated"
    for level in LEVELS:
        key = f"level_{level:g}"
        card = export_level(tmp_path / "run", level, tmp_path / f"export_{key}")
        assert card["normalisation"]["statistics"] == "federated"
        assert summary[f"final_deployable_acc/{key}"] == card["test_accuracy"], key  # to the digit
        # the test-batch figure, kept beside it, normalises the same weights otherwise
        assert rows[-1][f"deployable_loss/{key}"] != rows[-1][f"loss/{key}"], key
    print({k: v for k, v in summary.items() if "acc/" in k and k.startswith("final_")})
    # FedHM's global model is its γ = 1 model: one model, one figure
    assert summary["final_deployable_acc/global"] == summary["final_deployable_acc/level_1"]
    assert "best_deployable_acc/global" not in summary  # measured once


def test_the_global_model_apart_from_its_level_is_scored_with_its_own_statistics(toy_cfg, tmp_path):
    """FedAvg on the smallest model: its global model (recovered full rank) is not the level's
    model; both get a deployable figure. With evaluation.bn_stats=federated the final evaluation's
    sums are the deployment's, so the two figures of every model are one measurement."""
    summary, rows = _run(toy_cfg("rounds=1 method=fedavg_smallest"), tmp_path / "a")
    assert {"final_deployable_acc/global", "final_deployable_acc/level_0.125"} <= summary.keys()
    assert rows[-1]["deployable_loss/global"] != rows[-1]["deployable_loss/level_0.125"]
    assert rows[-1]["deployable_loss/global"] != rows[-1]["loss/global"]
    saved, _ = load_bn_statistics(tmp_path / "a")
    assert {k.split("/")[0] for k in saved} == {"level_0.125"}  # only what an export ships is saved

    summary, rows = _run(toy_cfg("rounds=1 method=fedavg_smallest evaluation.bn_stats=federated"), tmp_path / "b")
    assert summary["bn_stats"] == summary["deployable_bn_stats"] == "federated"
    for key in ("global", "level_0.125"):
        assert summary[f"final_deployable_acc/{key}"] == summary[f"final_acc/{key}"]
        assert rows[-1][f"deployable_loss/{key}"] == rows[-1][f"loss/{key}"]


def test_clients_only_evaluation_says_why_there_is_no_deployable_figure(toy_cfg, tmp_path):
    summary, _ = _run(toy_cfg("rounds=1 evaluation.where=clients"), tmp_path)
    assert not [k for k in summary if k.startswith("final_deployable_acc/")]
    assert summary["deployable_bn_stats"].startswith("not measured: evaluation.where=clients")
    assert load_bn_statistics(tmp_path) is not None  # the export still gets its statistics
    assert summary["final_fed_acc/all"] is not None


def test_a_run_records_the_code_it_started_with(toy_cfg, tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    summary, _ = _run(toy_cfg("rounds=1 evaluation.levels=false evaluation.deploy_stats=false"), tmp_path)
    assert summary["code_commit"] == head.stdout.strip() and isinstance(summary["code_dirty"], bool)
    assert summary["deployable_bn_stats"].startswith("not measured: evaluation.deploy_stats=false")
    assert read_status(tmp_path)["code_commit"] == summary["code_commit"]


def test_code_version_without_git_or_outside_a_checkout_is_unknown(tmp_path, monkeypatch):
    assert code_version(tmp_path) == {"code_commit": "unknown", "code_dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git program at all
    assert code_version(ROOT) == {"code_commit": "unknown", "code_dirty": None}
    assert version_label("unknown", None) == "unknown"
    assert version_label("abc1234", True) == "abc1234 (with uncommitted changes)"
