"""Models that work where they are used: a run, then `fedhm export` (the README's command, a real
process), and the exported model classifying images the way a device does (one at a time, or in
batches of one class).

The runs are in process (tests/inprocess_helpers.py: the numbers of the same `fedhm run`, without
Flower's start-up, ~20 s a run here). `fedhm run` itself is tested in tests/test_end_to_end.py and
tests/test_lifecycle.py; the deployment statistics that make an export batch-independent arriving
through real SuperNodes and the wire, in tests/test_deploy_docs.py (its export's card says
``federated``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess_helpers import run_in_process

from fedhm_flwr.config import data_spec, load_config, resume_config
from fedhm_flwr.data import test_dataset
from fedhm_flwr.ops.tools.export import load_model

MODELS = ("shufflenet_v2_x0_5", "mobilenet_v3_small", "efficientnet_b0", "resnet18")


def _fedhm(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "fedhm_flwr", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _run(*overrides: str, run_dir: Path, server_threads: int | None = None) -> None:
    """The job of ``overrides`` (Hydra overrides, as `fedhm run` takes them) in process, into ``run_dir``."""
    cfg = load_config(list(overrides))
    assert run_in_process(cfg, run_dir, server_threads=server_threads)["rounds_completed"] == int(cfg.rounds)


def _accuracy(predict, images: torch.Tensor, labels: torch.Tensor, batch: int) -> float:
    with torch.no_grad():
        preds = torch.cat([predict(images[i : i + batch]).argmax(1) for i in range(0, len(labels), batch)])
    return float((preds == labels).float().mean())


def _check_export(run_dir: Path, level: str) -> dict:
    """`fedhm export` of ``level``: the same accuracy on the run's test images at batch sizes 1, 2
    and 256 and in batches holding one class each (the safetensors model and the .pt2 program),
    equal to the card's."""
    _fedhm("export", f"run={run_dir}", f"level={level}")
    folder = next((run_dir / "export").iterdir())
    card = json.loads((folder / "model_card.json").read_text())
    test = test_dataset(data_spec(resume_config(run_dir)))
    x, y = test.images, test.labels
    order = torch.argsort(y, stable=True)  # sorted by class: most batches hold one class only
    model = load_model(folder / "model.safetensors")
    program = torch.export.load(str(folder / "model.pt2")).module()
    scores = {f"batch {b}": _accuracy(model, x, y, b) for b in (1, 2, 256)}
    scores["sorted, batch 8"] = _accuracy(model, x[order], y[order], 8)
    scores["pt2, batch 1"] = _accuracy(program, x, y, 1)
    scores["pt2 sorted, batch 8"] = _accuracy(program, x[order], y[order], 8)
    print(level, scores, card["test_accuracy"], card["normalisation"])
    for name, acc in scores.items():
        assert abs(acc - card["test_accuracy"]) <= 0.001, (name, scores, card["test_accuracy"])
    assert card["test_examples"] == len(y)
    return card


@pytest.mark.slow
def test_the_default_cnn_job_exports_a_model_that_ignores_the_batch(tmp_path):
    out = tmp_path / "run"
    _run("rounds=1", "num_clients=4", "dataset.max_train_examples=2000", "dataset.max_test_examples=600", run_dir=out)
    card = _check_export(out, "1/8")
    assert card["normalisation"]["statistics"] == "federated" and card["test_accuracy"] > 0.3
    assert card["preprocessing"]["mean"] == [0.286] and card["preprocessing"]["class_names"][0] == "T-shirt/top"


def _coloured_folder(root: Path, classes: int = 5, per_class: int = 60, size: int = 32) -> Path:
    """A 5-class ImageFolder whose class is a colour (learnable in two rounds), with texture noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, (classes, 3))
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(palette[c] + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{i}.png")
    return root


@pytest.mark.slow
def test_a_torchvision_bn_model_learns_with_defaults_and_its_export_ignores_the_batch(tmp_path):
    """shufflenet_v2_x0_5 (ordinary BatchNorm) on an image folder, default settings: above chance
    within 3 rounds, the row names the statistics it used; its export is batch-independent, and the
    card's preprocessing turns a raw image file into the model's input.

    The run's numbers do not depend on the machine's core count: the clients compute on one thread
    (``simulation.num_cpus``) and the server here on one too (``server_threads=1``). On the server's
    default count (the core count, or ``OMP_NUM_THREADS``) its SVDs and reductions (BatchNorm's
    statistics, sums) round differently per count, and a from-scratch network's 3 rounds follow
    another trajectory: this job at 60 images a class, seed 0, reached 0.58 at 2 server threads and
    0.90 at 1 here, 0.33 on another machine (#53). Kernels that round differently (another CPU's
    vector unit; here ``ATEN_CPU_CAPABILITY=default``) still change the trajectory, so the claim
    needs a margin: the best round of this job (150 images a class, 30 of them test images) was
    0.80, 0.62 and 0.49 for seeds 0-2, 0.80 for seed 0 on the other kernels; at 60 images a class,
    seeds 0-3 reached 0.90, 0.43, 0.47 and 0.40."""
    from fedhm_flwr.data import source_arrays

    imgs, out = _coloured_folder(tmp_path / "imgs", per_class=150), tmp_path / "run"
    _run(
        "model.target=torchvision.models:shufflenet_v2_x0_5",
        "model.kwargs.num_classes=5",
        "dataset=imagefolder",
        f"dataset.path={imgs}",
        "dataset.image_size=32",
        "dataset.channels=3",
        "rounds=3",
        "num_clients=2",
        "fraction_train=1.0",
        run_dir=out,
        server_threads=1,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print([{k: v for k, v in row.items() if k.startswith(("acc/", "bn_stats"))} for row in rows])
    assert rows[-1]["bn_stats"] == "test_batch"  # static BN (the default for a model.target) with test batches
    # chance is 0.2; on 150 test images 0.4 is 6 standard deviations above it (a model that did not
    # learn does not reach it in 3 rounds by chance). Seed 0 (here, any core count) reaches 0.57,
    # 0.66, 0.80. A few rounds from scratch are noisy: the claim is "learns", so the best round counts
    assert max(row["acc/global"] for row in rows) > 0.4
    card = _check_export(out, "1/8")
    assert card["normalisation"]["statistics"] == "federated"

    # a device: decoded pixels, the card's preprocessing, the .pt2 program one image at a time: the
    # same input and logits as the project's own loading of the test images
    pre = card["preprocessing"]
    assert pre["class_names"] == [f"class_{c}" for c in range(5)] and pre["image_size"] == 32
    cfg = resume_config(out)
    raw, labels = source_arrays(data_spec(cfg), "test")  # uint8 NHWC, as decoded and fitted
    assert len(labels) == 150  # the accuracies above are on 150 test images (test_fraction 0.2)
    test = test_dataset(data_spec(cfg))
    mean, std = torch.tensor(pre["mean"]).view(-1, 1, 1), torch.tensor(pre["std"]).view(-1, 1, 1)
    folder = next((out / "export").iterdir())
    program = torch.export.load(str(folder / "model.pt2")).module()
    correct = 0
    with torch.no_grad():
        for i in range(len(labels)):
            x = (torch.from_numpy(raw[i].astype(np.float32) / 255.0).permute(2, 0, 1) - mean) / std
            torch.testing.assert_close(x, test.images[i], rtol=1e-5, atol=1e-5)
            correct += int(program(x.unsqueeze(0)).argmax(1).item() == int(labels[i]))
    assert abs(correct / len(labels) - card["test_accuracy"]) <= 0.001


@pytest.mark.parametrize("name", MODELS)
def test_fedhm_inspect_makes_every_reduced_level_strictly_smaller(name, capsys):
    from fedhm_flwr.ops.tools.cost_table import main

    assert (
        main([f"model.target=torchvision.models:{name}", "model.kwargs.num_classes=10", "dataset=cifar10", "--json"])
        == 0
    )
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    full = next(r["params"] for r in rows if r["ratio"] == 1.0)
    for row in rows:
        if row["ratio"] < 1:
            assert row["params"] < full and row["of_full"] < 1, (name, row)
    assert "warning" not in captured.err


def test_inspect_warns_when_no_level_is_smaller(capsys):
    from fedhm_flwr.ops.tools.cost_table import main

    assert (
        main(
            [
                "model.target=torchvision.models:shufflenet_v2_x0_5",
                "model.kwargs.num_classes=10",
                "dataset=cifar10",
                "model.factorize.pointwise=false",
            ]
        )
        == 0
    )  # only the stem: kept full
    err = capsys.readouterr().err
    assert "factorizes no layer" in err and "model.factorize" in err


def test_the_config_check_builds_a_model_the_meta_device_cannot(tmp_path):
    """torchvision's RegNet initialises weights in a way the meta device refuses: checked on the CPU."""
    from fedhm_flwr.config import ConfigError, load_config

    cfg = load_config("model.target=torchvision.models:regnet_x_400mf model.kwargs.num_classes=10 dataset=cifar10")
    assert cfg.model.arch == "custom"
    with pytest.raises(ConfigError, match=r"num_classes.*10 classes and the model gives 7 outputs"):
        load_config("model.target=torchvision.models:regnet_x_400mf model.kwargs.num_classes=7 dataset=cifar10")
