"""TensorBoard/MLflow tracking and deployable exports, read back from one tiny in-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fedhm_flwr.config import ConfigError, load_config, model_spec, run_options
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.ops.tools.export import SPEC_KEY, export_level, load_model, main as export_main, parse_level
from fedhm_flwr.reporting.results import load_checkpoint
from fedhm_flwr.reporting.tracking import TB_DIR, flat_config, scalars
from fedhm_flwr.server.registry import STRATEGIES

HAS_MLFLOW = __import__("importlib").util.find_spec("mlflow") is not None

TINY = (
    "num_clients=4 fraction_train=1.0 dataset.max_train_examples=800 dataset.max_test_examples=200 "
    "model.width=4 train.batch_size=64 evaluation.batch_size=100 rounds=2 failures.crash_probability=0.3"
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two FedHM rounds on the in-process grid (one client crashes now and then: failures > 0),
    tracked by TensorBoard and, when installed, MLflow."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(f"{TINY} tracking.mlflow={str(HAS_MLFLOW).lower()}")
    run(LocalGrid(4, client_handlers()), cfg, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, cfg, rows


def test_scalars_keep_every_numeric_key_and_nothing_else():
    row = {
        "round": 3,
        "acc/global": 0.5,
        "bytes_sent": 10,
        "ok": True,
        "assignments": "{}",
        "fed_acc": None,
        "loss/global": float("nan"),
    }
    assert scalars(row) == {"acc/global": 0.5, "bytes_sent": 10.0}
    assert flat_config({"a": {"b": [1, 2], "c": None}, "d": "x"}) == {"a.b": "[1, 2]", "a.c": "null", "d": "x"}


def test_tensorboard_events_hold_every_rounds_scalars_and_the_config(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, _cfg, rows = tiny_run
    acc = EventAccumulator(str(out / TB_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {k for r in rows for k in scalars(r)}
    assert (
        {"acc/global", "loss/global", "acc/level_0.125", "bytes_sent", "bytes_received", "seconds", "failures"}
        <= expected
        == tags
    )
    assert sum(r["failures"] for r in rows) > 0  # the failures column is a real, non-zero series
    for key in tags:
        logged = {e.step: e.value for e in acc.Scalars(key)}
        want = {r["round"]: float(r[key]) for r in rows if key in scalars(r)}
        assert logged.keys() == want.keys(), key
        for step, value in want.items():  # event files hold float32
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (key, step)
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["method.name"].string_value == "fedhm"
    assert start.hparams["rounds"].number_value == 2
    assert start.hparams["levels.ratios"].string_value == "[1.0, 0.5, 0.25, 0.125]"


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow (extra [mlflow]) not installed")
def test_mlflow_run_holds_the_same_metrics_and_the_config(tiny_run):
    from mlflow.tracking import MlflowClient

    out, _cfg, rows = tiny_run
    info = json.loads((out / "mlflow_run.json").read_text())
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    mlrun = client.get_run(info["run_id"])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["method.name"] == "fedhm" and mlrun.data.params["rounds"] == "2"
    for key in ("acc/global", "acc/level_0.125", "bytes_sent", "failures"):
        history = {m.step: m.value for m in client.get_metric_history(info["run_id"], key)}
        assert history == {r["round"]: float(r[key]) for r in rows}


def test_a_resumed_run_goes_on_in_the_same_event_folder_and_mlflow_run(tiny_run, tmp_path):
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedhm_flwr.config import resume_config

    src, _, _ = tiny_run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    if HAS_MLFLOW:  # the copy's file store lives in the copy
        info = json.loads((out / "mlflow_run.json").read_text())
        info["tracking_uri"] = (out / "mlruns").resolve().as_uri()
        (out / "mlflow_run.json").write_text(json.dumps(info))
        for meta in (out / "mlruns").rglob("meta.yaml"):
            meta.write_text(meta.read_text().replace(str(src), str(out)))
    run(LocalGrid(4, client_handlers()), resume_config(out, "rounds=3"), out, resume=out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    acc = EventAccumulator(str(out / TB_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("acc/global")} == pytest.approx(
        {r["round"]: r["acc/global"] for r in rows}, rel=1e-6
    )
    if HAS_MLFLOW:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=info["tracking_uri"])
        assert json.loads((out / "mlflow_run.json").read_text())["run_id"] == info["run_id"]
        history = client.get_metric_history(info["run_id"], "acc/global")
        assert {m.step: m.value for m in history} == {r["round"]: r["acc/global"] for r in rows}
        assert client.get_run(info["run_id"]).info.status == "FINISHED"


def test_mlflow_without_the_package_is_refused_before_the_run(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking\.mlflow"):
        load_config("tracking.mlflow=true")
    with pytest.raises(ConfigError, match=r"tracking\.tensorboard"):
        load_config("tracking.tensorboard=maybe")


def test_parse_level_accepts_numbers_and_fractions_and_names_the_levels():
    levels = [1.0, 0.5, 0.25, 0.125]
    assert parse_level("1/8", levels) == 3 and parse_level("0.5", levels) == 1 and parse_level(1, levels) == 0
    with pytest.raises(ConfigError, match=r"level.*\['1', '0.5', '0.25', '0.125'\]"):
        parse_level("0.3", levels)


def test_export_is_the_in_run_cut_with_the_federated_statistics_fixed(tiny_run, tmp_path):
    out, cfg, rows = tiny_run
    card = export_level(out, "1/8", tmp_path / "exp")
    folder = Path(card["out_dir"])
    assert {"model.safetensors", "model.pt2", "model.onnx", "model_card.md", "model_card.json"} == {
        p.name for p in folder.iterdir()
    }

    # the in-run deployable model, built here from the checkpoint and the strategy's own cut, with
    # the statistics the clients summed after the last round (saved beside the checkpoint)
    state, saved = load_checkpoint(out)
    strategy = STRATEGIES["fedhm"](run_options(cfg), model_spec(cfg))
    spec, level_state = strategy.method.deployable(3, state)
    from fedhm_flwr.math.bn_stats import apply_bn_statistics
    from fedhm_flwr.models import build_model
    from fedhm_flwr.reporting.results import load_bn_statistics

    tensors, metadata = load_bn_statistics(out)
    assert metadata["round"] == str(saved["round"]) and metadata["source"] == "federated"
    reference = build_model(spec, spectral_init=False)
    reference.load_state_dict(level_state)
    apply_bn_statistics(reference, {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("level_0.125/")})
    reference.eval()

    model = load_model(folder / "model.safetensors")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        assert json.loads(fh.metadata()[SPEC_KEY]) == {**spec, "bn_fixed": True} and spec["ranks"]  # factorized
    weights = model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in level_state.items())  # the cut itself, bit for bit
    assert {k for k in weights if k not in level_state} and all(  # + every norm layer's fixed statistics
        k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in weights if k not in level_state
    )
    batch = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(batch)
        assert torch.equal(model(batch), want)
        one_by_one = torch.cat([model(batch[i : i + 1]) for i in range(len(batch))])
        torch.testing.assert_close(one_by_one, want, rtol=1e-5, atol=1e-5)  # the batch does not matter
        program = torch.export.load(str(folder / "model.pt2")).module()
        torch.testing.assert_close(program(batch[:1]), want[:1], rtol=1e-5, atol=1e-5)

    # the card: the level's exact size, the statistics, and the accuracy of the exported file
    summary = json.loads((out / "summary.json").read_text())
    assert card["parameters"] == int(summary["level_costs"]["0.125"]["params"])
    assert card["macs_per_input"] == int(summary["level_costs"]["0.125"]["macs"])
    assert card["final_accuracy"] == summary["final_acc/level_0.125"] == rows[-1]["acc/level_0.125"]
    assert card["final_fed_accuracy"] is None  # the server's test set only (evaluation.where=server)
    assert card["run_bn_stats"] == "test_batch" and card["normalisation"]["statistics"] == "federated"
    from fedhm_flwr.config import data_spec
    from fedhm_flwr.data import test_dataset
    from fedhm_flwr.math.train import evaluate

    test = test_dataset(data_spec(cfg))
    assert card["test_examples"] == len(test) == 200
    for batch_size in (1, 7, 200):
        assert evaluate(model, test, batch_size, torch.device("cpu"))["accuracy"] == card["test_accuracy"]
    # the run's deployable figure is the exported file's own score, to the digit; the test-batch
    # figure beside it is another measurement (the same weights normalised by each test batch)
    assert summary["deployable_bn_stats"] == "federated" and summary["bn_stats"] == "test_batch"
    assert summary["final_deployable_acc/level_0.125"] == card["test_accuracy"] == card["final_deployable_accuracy"]
    assert rows[-1]["deployable_loss/level_0.125"] != rows[-1]["loss/level_0.125"]
    assert "deployable_acc/level_0.125" not in rows[0]  # measured once, after the last round
    pre = card["preprocessing"]
    assert pre["image_size"] == 28 and pre["channels"] == 1 and pre["class_names"][9] == "Ankle boot"
    assert json.loads((folder / "model_card.json").read_text())["parameters"] == card["parameters"]
    assert f"{card['parameters']:,}" in (folder / "model_card.md").read_text()


def test_api_load_model_is_the_exported_model(tiny_run, tmp_path):
    from fedhm_flwr.api import load_model as api_load_model

    out, _, _ = tiny_run
    card = export_level(out, "1/4", tmp_path / "exp")
    exported, loaded = load_model(Path(card["out_dir"]) / "model.safetensors"), api_load_model(out, 0.25)
    assert not loaded.training
    x = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(x), exported(x))
        torch.testing.assert_close(loaded(x[:1]), loaded(x)[:1], rtol=1e-5, atol=1e-5)


def test_export_without_saved_statistics_uses_the_local_training_set_and_says_so(tiny_run, tmp_path):
    import shutil

    from fedhm_flwr.reporting.results import BN_STATS_FILE, CHECKPOINT_DIR

    out, _, _ = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / CHECKPOINT_DIR / BN_STATS_FILE).unlink()  # a checkpoint written before the last round
    card = export_level(copy, "1/4", tmp_path / "exp")
    assert card["normalisation"]["statistics"] == "training_data" and "800 examples" in card["normalisation"]["data"]
    model = load_model(Path(card["out_dir"]) / "model.safetensors")
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([model(x[i : i + 1]) for i in range(4)]), model(x), rtol=1e-5, atol=1e-5)


def test_export_command_refuses_bad_input_naming_the_field(tiny_run, tmp_path, capsys):
    out, _, _ = tiny_run
    assert export_main([f"run={out}", "level=0.3"]) == 2
    assert "level" in capsys.readouterr().err
    assert export_main([f"run={tmp_path}", "level=1"]) == 2
    assert "run" in capsys.readouterr().err
    assert export_main([f"run={out}", "gamma=1"]) == 2
    assert "['run', 'level', 'out']" in capsys.readouterr().err
