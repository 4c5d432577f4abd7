"""FedAvg through Flower against a bare PyTorch loop written without Flower (bench/bare_fedavg.py).

The Flower side runs the project's ServerApp ``run`` on the in-process grid (the same strategy,
messages and client handlers as the Ray engine); the bare loop shares only the data functions.
On a CPU with one torch thread per client both do the same float operations in the same order,
so the final models must be equal bit for bit (no tolerance).
"""

import json

import torch

from bench.bare_fedavg import run_bare_fedavg, sample
from fedhm_flwr.config import data_spec, model_spec as flower_spec
from fedhm_flwr.data import client_dataset
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state, run
from fedhm_flwr.reporting.results import load_checkpoint

# non-IID (Dir(0.1): clients miss classes, so masked CE and per-class classifier rows matter),
# half the clients per round, a cosine schedule, two local epochs
BARE = (
    "method=fedavg rounds=3 fraction_train=0.5 partition.alpha=0.1 train.lr_schedule=cosine "
    "train.local_epochs=2 evaluation.levels=false"
)


def test_bare_pytorch_fedavg_equals_the_flower_run(toy_cfg, tmp_path):
    cfg = toy_cfg(BARE)
    bare, history = run_bare_fedavg(cfg)
    run(LocalGrid(int(cfg.num_clients), client_handlers()), toy_cfg(BARE), tmp_path / "run")
    flower, _ = load_checkpoint(tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the same partitions trained in every round, at the same learning rate
    assert [sorted(int(p[1:]) for p in json.loads(r["assignments"])) for r in rows] == [
        h["partitions"] for h in history
    ]
    assert [r["lr"] for r in rows] == [h["lr"] for h in history]
    # the work exercises masking and per-class rows: some sampled client misses some class
    data = data_spec(cfg)
    assert any((client_dataset(data, p).class_counts() == 0).any() for h in history for p in h["partitions"])
    assert bare.keys() == flower.keys()
    # Tolerance: both average float32 tensors with a float32 vector-matrix product (the project over
    # all keys at once, the bare loop key by key), so they agree to the last bit or within a few
    # ulps; a float64 average would differ by an ulp per round, which SGD amplifies (4.5e-4 after 3
    # rounds here). Training itself is bit-identical (the same batches, seeds and kernels on CPU),
    # so any real difference (partitions, weights, masking, per-class rows) shows up far above this.
    different = {k: float((bare[k] - flower[k]).abs().max()) for k in bare}
    assert max(different.values()) <= 1e-6, f"bare loop and Flower differ: {different}"
    # and training moved the model (the comparison is not between two initial models)
    start = initial_state(cfg.seed, flower_spec(cfg))
    assert all(not torch.equal(start[k], bare[k]) for k in ("conv1.weight", "fc.weight"))


def test_sampling_draws_half_of_the_partitions_per_round_without_repeats():
    for server_round in range(1, 6):
        picked = sample(0, server_round, 20, 0.5, 2)
        assert len(picked) == len(set(picked)) == 10 and all(0 <= p < 20 for p in picked)
    assert sample(0, 1, 20, 0.5, 2) != sample(0, 2, 20, 0.5, 2)
