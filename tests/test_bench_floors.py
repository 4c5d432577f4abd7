"""The bench's floors (bench/floors.py, figure 8's bare loop bench/whole_job_floor.py) are written apart
from the code they bound: they import nothing from the project, and each computes what the code it is
compared with computes."""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import floors, whole_job_floor as job_floor
from fedhm_flwr.math.aggregation import average_hybrid
from fedhm_flwr.math.lowrank import factorize_state, layer_svd, rank_for
from fedhm_flwr.models import build_model
from fedhm_flwr.models.rules import plan_ranks

FLOORS = Path(floors.__file__)
JOB_FLOOR = Path(job_floor.__file__)
#: what the floor modules may import: the standard library's pieces they use, numpy and torch
FLOOR_IMPORTS = {
    "__future__",
    "gzip",
    "inspect",
    "json",
    "math",
    "multiprocessing",
    "sys",
    "time",
    "pathlib",
    "collections",
    "typing",
    "numpy",
    "torch",
}


def _modules(path: Path) -> set[str]:
    """The modules a file imports (anywhere in it), as written."""
    tree = ast.parse(path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return imported | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def _imports(path: Path) -> set[str]:
    """The top-level packages a file imports (anywhere in it)."""
    return {m.split(".")[0] for m in _modules(path)}


def test_floor_code_imports_nothing_from_the_project():
    imported = _imports(FLOORS)
    assert imported and imported <= FLOOR_IMPORTS, imported
    assert floors.where(floors.average_floor).startswith("bench/floors.py:")


def test_whole_job_floor_imports_nothing_from_the_project():
    """Figure 8's bare loop: the same allowance, plus bench.floors (checked above) and nothing else of bench."""
    project = {m for m in _modules(JOB_FLOOR) if m.split(".")[0] not in FLOOR_IMPORTS}
    assert project == {"bench.floors"}, project
    assert _imports(JOB_FLOOR) <= FLOOR_IMPORTS | {"bench"}


def test_average_floor_equals_the_projects_hybrid_average():
    torch.manual_seed(0)
    spec = {"arch": "resnet18", "num_classes": 10, "in_channels": 3, "image_size": 32, "width": 8}
    model = build_model(spec)
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    plans = [plan_ranks(model, g) for g in (1.0, 0.5, 0.25, 0.5)]
    replies = []
    for plan in plans:
        noisy = {k: (v + 0.01 * torch.randn_like(v)) if v.is_floating_point() else v for k, v in previous.items()}
        replies.append(factorize_state(noisy, plan) if plan else noisy)
    weights = [0.4, 0.3, 0.2, 0.1]
    expected = average_hybrid(previous, replies, plans, np.asarray(weights))
    got = floors.average_floor(previous, replies, weights)
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(got[key].float(), expected[key].float(), rtol=1e-4, atol=1e-5)


def test_decomposition_floor_cuts_the_same_subspace_as_layer_svd():
    torch.manual_seed(0)
    weight = torch.randn(32, 64, 3, 3) * 0.05  # a wide unrolling (96 × 192): both cut its rows' side
    rank = rank_for(weight.shape, 0.25)
    (Q,) = floors.decomposition_floor([weight], [rank])
    svd = layer_svd(weight, [rank])
    M = floors.unroll(weight).double()
    ours = svd.U[:, :rank].double() @ (svd.U[:, :rank].double().t() @ M)
    theirs = Q.double() @ (Q.double().t() @ M)
    assert (torch.linalg.norm(ours - theirs) / torch.linalg.norm(M)).item() < 1e-4


def test_training_floor_sees_every_example_each_epoch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    images, labels = torch.randn(70, 1, 4, 4), torch.randint(0, 3, (70,))
    before = [p.detach().clone() for p in model.parameters()]
    assert floors.training_floor(model, images, labels, epochs=2, batch_size=32) == 140
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


ENGINE_FLOOR = FLOORS.with_name("engine_floor.py")


def test_engine_floor_imports_nothing_from_the_project():
    assert _imports(ENGINE_FLOOR) <= {
        "__future__",
        "argparse",
        "json",
        "random",
        "subprocess",
        "sys",
        "time",
        "pathlib",
        "typing",
        "numpy",
        "flwr",
    }, _imports(ENGINE_FLOOR)


@pytest.mark.slow
def test_engine_floor_sends_the_scale_runs_traffic_and_every_message_is_answered():
    from bench.engine_floor import engine_rounds

    rounds, per_round = 3, 4
    # the two runs side by side (each a subprocess with a private Ray instance, mostly Ray's start-up)
    with ThreadPoolExecutor(2) as pool:
        queried = pool.submit(engine_rounds, 12, 1.0, True, rounds, per_round, timeout=300)
        unqueried = pool.submit(engine_rounds, 12, 1.0, False, 2, per_round, timeout=300)
        with_queries, without = queried.result(), unqueried.result()
    assert len(with_queries["round_seconds"]) == rounds
    # every training message answered; a query to round 1's sample at start-up, then one to each later round's
    assert with_queries["replies"] == {"train": rounds * per_round, "query": rounds * per_round}
    assert without["replies"] == {"train": 2 * per_round}


def test_whole_job_floor_cut_is_exact_at_full_rank():
    torch.manual_seed(0)
    weight = torch.randn(64, 32, 3, 3)
    b, a = job_floor.cut(weight, job_floor.svd_of(weight), 3 * 32)
    torch.testing.assert_close(job_floor.multiply_back(b, a), weight, rtol=1e-4, atol=1e-5)
    state = job_floor.cnn_state(16)
    x = torch.randn(8, 1, 28, 28)
    factored = {k: v for k, v in state.items() if k != "conv3.weight"}
    factored["conv3.b.weight"], factored["conv3.a.weight"] = job_floor.cut(
        state["conv3.weight"], job_floor.svd_of(state["conv3.weight"]), 3 * 32
    )
    torch.testing.assert_close(
        job_floor.cnn_forward(factored, x), job_floor.cnn_forward(state, x), rtol=1e-4, atol=1e-4
    )


def test_whole_job_floor_average_equals_a_hand_computed_one():
    # two replies, levels 1 (full) and 0.5 (a rank-1 pair): alpha = softmax([1, 0.5])
    full = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).reshape(2, 1, 3, 3)
    b = torch.tensor([[[[1.0, 2.0, 3.0]]]])  # (r=1, m=1, 1, k=3)
    a = torch.tensor([[[[1.0], [0.0], [-1.0]]], [[[2.0], [1.0], [0.0]]]])  # (n=2, r=1, k=3, 1)
    pair = torch.einsum("ori,rcj->ocij", a[..., 0], b[:, :, 0, :])  # W[o, c, i, j] = a[o, 0, i] b[0, c, j]
    state = {"conv3.weight": torch.zeros(2, 1, 3, 3), "fc.bias": torch.zeros(2)}
    replies = [
        (1.0, {"conv3.weight": full, "fc.bias": torch.tensor([1.0, 0.0])}),
        (0.5, {"conv3.b.weight": b, "conv3.a.weight": a, "fc.bias": torch.tensor([0.0, 1.0])}),
    ]
    e1, e2 = np.exp(1.0), np.exp(0.5)
    w1, w2 = e1 / (e1 + e2), e2 / (e1 + e2)
    got = job_floor.fedhm_average(state, replies)
    torch.testing.assert_close(got["conv3.weight"].float(), (w1 * full + w2 * pair).float())
    torch.testing.assert_close(got["fc.bias"].float(), torch.tensor([w1, w2], dtype=torch.float32))


def test_whole_job_floor_trains_the_projects_level_shapes():
    """The bare loop's level models have the shapes the project's FedHM hands its clients (the same work)."""
    spec = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 16}
    model = build_model(spec)
    ours = job_floor.cnn_state(16)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    svds = {k: job_floor.svd_of(v) for k, v in ours.items() if k in ("conv3.weight", "conv4.weight")}
    for gamma in (1.0, 0.5, 0.25, 0.125):
        plan = plan_ranks(model, gamma)
        theirs = factorize_state(model.state_dict(), plan) if plan else model.state_dict()
        got = job_floor.level_model(ours, svds, gamma)
        assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in theirs.items()}, gamma


def test_read_idx_reads_the_installed_fashion_mnist():
    folder = Path("/usr/share/datasets/fashion-mnist")
    if not folder.is_dir():
        pytest.skip("Fashion-MNIST is not installed")
    x, y = job_floor.fashion_mnist(folder, "t10k")
    assert x.shape == (10000, 1, 28, 28) and y.shape == (10000,) and set(y.tolist()) == set(range(10))
