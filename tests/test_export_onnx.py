"""`fedhm export`'s model.onnx in ONNX Runtime (one image at a time, as a device runs it), the
card's snippet run on a raw test image, the clients' federated accuracy on the card, and the
permissions of the files a run and an export write, on one tiny in-process run that evaluates on
the clients only (evaluation.where=clients)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhm_flwr.config import data_spec, load_config
from fedhm_flwr.data import check_data_spec, class_names, source_arrays, source_info, test_dataset, to_normalised_tensor
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run
from fedhm_flwr.ops.tools.export import load_model, main as export_main
from fedhm_flwr.ops.tools.onnx_model import OnnxCheckFailed, check_onnx
from fedhm_flwr.reporting.results import atomic_write

ort = pytest.importorskip("onnxruntime")  # installed by `make setup` (a dependency of the project)

CLIENTS = (
    "num_clients=4 fraction_train=1.0 dataset.max_train_examples=800 dataset.max_test_examples=200 "
    "model.width=4 train.batch_size=64 evaluation.batch_size=100 rounds=2 evaluation.where=clients"
)
LEVEL = "0.125"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _with_umask(umask: int, fn, *args):
    old = os.umask(umask)
    try:
        return fn(*args)
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def clients_run(tmp_path_factory):
    """Two FedHM rounds on the in-process grid, federated evaluation only, written under umask 027."""
    out = tmp_path_factory.mktemp("run")
    _with_umask(0o027, run, LocalGrid(4, client_handlers()), load_config(CLIENTS), out)
    return out


@pytest.fixture(scope="module")
def exported(clients_run, tmp_path_factory):
    """`fedhm export run=<run> level=1/8 out=<dir>` (the command's entry point), under umask 022."""
    folder = tmp_path_factory.mktemp("export") / "level"
    assert _with_umask(0o022, export_main, [f"run={clients_run}", "level=1/8", f"out={folder}"]) == 0
    return folder, json.loads((folder / "model_card.json").read_text())


def test_atomic_write_gives_a_new_file_open_s_permissions(tmp_path):
    for umask in (0o022, 0o077, 0o002):
        path = tmp_path / f"file_{umask:o}"
        _with_umask(umask, atomic_write, path, "x")
        assert _mode(path) == 0o666 & ~umask and path.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file_2", "file_22", "file_77"]  # no temporary left


def test_a_runs_files_follow_the_umask(clients_run):
    files = {p.relative_to(clients_run).as_posix(): p for p in clients_run.rglob("*") if p.is_file()}
    assert {
        "summary.json",
        "config.yaml",
        "metrics.jsonl",
        "metrics.csv",
        "accuracy.png",
        "status.json",
        "checkpoint/global_model.safetensors",
        "checkpoint/bn_statistics.safetensors",
    } <= set(files)
    assert {name: oct(_mode(p)) for name, p in files.items() if _mode(p) != 0o640} == {}


def test_onnx_runtime_one_image_at_a_time_has_the_cards_accuracy(clients_run, exported):
    folder, card = exported
    assert sorted(p.name for p in folder.iterdir()) == [  # one self-contained ONNX file, no external data
        "model.onnx",
        "model.pt2",
        "model.safetensors",
        "model_card.json",
        "model_card.md",
    ]
    assert all(_mode(p) == 0o644 for p in folder.iterdir())

    cfg = load_config(CLIENTS)
    test = test_dataset(data_spec(cfg))
    x, y = test.images.numpy(), test.labels.numpy()
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"] and session.get_inputs()[0].shape == ["batch", 1, 28, 28]
    logits = np.concatenate([session.run(None, {"input": x[i : i + 1]})[0] for i in range(len(x))])
    with torch.no_grad():
        reference = load_model(folder / "model.safetensors")(test.images).numpy()

    figures = card["onnx_runtime"]
    assert figures["batch_size"] == 1 and figures["examples"] == len(y) == 200
    assert figures["accuracy"] == float(np.mean(logits.argmax(1) == y))
    assert card["test_accuracy"] == float(np.mean(reference.argmax(1) == y))
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4)  # the card's stated tolerance
    assert figures["max_abs_logit_difference"] <= 1e-4 and (figures["atol"], figures["rtol"]) == (1e-4, 1e-4)
    # the same predictions, except on a tie at float32 precision (top two logits within the tolerance)
    top2 = np.sort(reference, 1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * (1e-4 + 1e-4 * np.abs(top2).max(1))
    assert np.array_equal(logits.argmax(1)[clear], reference.argmax(1)[clear])
    assert figures["predictions_agreeing"] == int(np.sum(logits.argmax(1) == reference.argmax(1)))
    md = (folder / "model_card.md").read_text()
    assert f"{figures['accuracy']:.4f} ({len(y)} images" in md and "one image at a time" in md
    # which test set: the dataset, its split, how many of its images (dataset.max_test_examples=200 of 10,000)
    which = "the fashion_mnist test split, 200 of its 10,000 images, a seeded subset (dataset.max_test_examples=200"
    assert card["test_set"].startswith(which) and f"| test set | {which}" in md
    assert f"200 images of {which}" in md and "the run's test set" not in md


def test_the_card_reports_the_clients_federated_accuracy(clients_run, exported):
    folder, card = exported
    summary = json.loads((clients_run / "summary.json").read_text())
    rows = [json.loads(line) for line in (clients_run / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("final_acc/") for k in summary)  # the server measured nothing
    last = [r for r in rows if r.get(f"fed_acc/level_{LEVEL}") is not None][-1]
    assert card["final_accuracy"] is None
    assert card["final_fed_accuracy"] == summary[f"final_fed_acc/level_{LEVEL}"] == last[f"fed_acc/level_{LEVEL}"]
    assert card["best_fed_accuracy"] == max(
        r[f"fed_acc/level_{LEVEL}"] for r in rows if r.get(f"fed_acc/level_{LEVEL}") is not None
    )
    assert card["fed_accuracy_round"] == last["round"] == 2
    md = (folder / "model_card.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| final federated accuracy"))
    assert f"{last[f'fed_acc/level_{LEVEL}']:.4f}" in line and "clients" in line
    assert "not recorded" not in md


def test_the_cards_snippet_classifies_raw_test_images_as_the_pytorch_model_does(
    exported, tmp_path, monkeypatch, capsys
):
    from PIL import Image

    folder = exported[0]
    md = (folder / "model_card.md").read_text()
    snippet = md.split("## Run it with ONNX Runtime", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    spec = check_data_spec(data_spec(load_config(CLIENTS)))
    raw, _ = source_arrays(spec, "test")  # uint8 NHWC, as the files hold them
    model = load_model(folder / "model.safetensors")
    with torch.no_grad():  # the project's own pipeline: its normalisation, the PyTorch model
        logits = model(to_normalised_tensor(raw[:100], source_info(spec)))
    top2 = logits.topk(2, 1).values
    picks = [int(i) for i in torch.nonzero(top2[:, 0] - top2[:, 1] > 1e-2).flatten()[:4]]  # no near-ties
    assert picks
    (tmp_path / "model.onnx").write_bytes((folder / "model.onnx").read_bytes())
    monkeypatch.chdir(tmp_path)
    names = class_names(spec)
    for k in picks:
        Image.fromarray(raw[k][:, :, 0]).save(tmp_path / "image.png")
        namespace: dict = {}
        exec(compile(snippet, "model_card.md", "exec"), namespace)
        want = int(logits[k].argmax())
        assert namespace["prediction"] == want and capsys.readouterr().out.strip() == names[want]


def test_the_check_refuses_logits_beyond_the_tolerance(exported):
    folder, _ = exported
    data = (folder / "model.onnx").read_bytes()
    x = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = load_model(folder / "model.safetensors")(x)
    assert check_onnx(data, x, reference + 5e-5)["predictions_agreeing"] == 5  # within 1e-4 + 1e-4 |logit|
    with pytest.raises(OnnxCheckFailed, match=r"refused.*beyond.*5 of 5 images"):
        check_onnx(data, x, reference + 1e-3)
    nan = reference.clone()
    nan[2, 0] = float("nan")
    with pytest.raises(OnnxCheckFailed, match="1 of 5 images"):
        check_onnx(data, x, nan)


def test_an_export_whose_onnx_file_disagrees_is_refused_and_writes_nothing(clients_run, tmp_path, monkeypatch, capsys):
    from fedhm_flwr.ops.tools import export

    real = export.onnx_bytes

    def off_by_a_bias(source, example):  # a wrong file: every logit moved by 0.01
        class Shifted(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = source.module() if isinstance(source, torch.export.ExportedProgram) else source

            def forward(self, x):
                return self.inner(x) + 0.01

        return real(Shifted(), example)

    monkeypatch.setattr(export, "onnx_bytes", off_by_a_bias)
    out = tmp_path / "exp"
    assert export_main([f"run={clients_run}", "level=1/8", f"out={out}"]) == 1
    err = capsys.readouterr().err
    assert "model.onnx refused" in err and "abs(ORT - PyTorch) <= 0.0001 + 0.0001 * abs(PyTorch)" in err
    assert not out.exists() or not any(out.iterdir())


def test_export_help_is_one_plain_usage(capsys):
    from fedhm_flwr.ops.cli import main as fedhm

    assert fedhm(["export", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.count("usage:") == 1 and "run=DIR" in text and "model.onnx" in text
    assert not any(mark in text for mark in (":func:", ":meth:", ":mod:", "``"))
