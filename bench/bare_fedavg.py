"""A FedAvg reference that is not Flower: a bare PyTorch loop (no Flower, no Ray, no strategy).

    python -m bench.bare_fedavg [HYDRA OVERRIDES ...] [--save model.safetensors]

It runs what a Flower run of ``method=fedavg`` (``variant=full``) runs, written out by hand, so
that the two final models can be compared (``tests/test_bare_fedavg.py``):

* data: the same partitions and test set (the project's data functions, for the data only);
* initialisation: ``torch.manual_seed(seed)``, then the model is built (as the ServerApp does);
* client sampling per round: ``max(min_train_nodes, int(fraction_train · N))`` partitions drawn
  without replacement by ``numpy.random.default_rng([seed, round, 0])`` from the sorted ids;
* per client and round: seed ``fedhm_flwr.math.levels.client_seed(seed, round, partition)`` for the
  torch RNG and the batch order (a ``DataLoader`` shuffled by its own generator), SGD with
  momentum and weight decay re-created at the round's learning rate (constant / cosine / step),
  masked cross-entropy (logits of classes absent from the partition set to 0), static batch norm
  (the models keep no running statistics), batches of one example skipped;
* aggregation: weights ``n_p / Σ n`` (sample counts) in float64, every float32 tensor the weighted
  sum over the clients in partition order as one float32 vector-matrix product (a float64 sum
  differs from any float32 server in the last bit, and SGD amplifies that over rounds: 4.5e-4
  after 3 rounds of 2 local epochs), other tensors in float64; the classifier's rows (one per class) only over the
  clients holding that class, weights renormalised, a class nobody held keeping its row.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from fedhm_flwr.config import data_spec, load_config, model_spec
from fedhm_flwr.data import client_dataset, test_dataset
from fedhm_flwr.math.levels import client_seed
from fedhm_flwr.models import build_model

State = dict[str, torch.Tensor]


def round_lr(cfg: DictConfig, server_round: int) -> float:
    """The learning rate of a round (rounds start at 1)."""
    base, total = float(cfg.train.lr), int(cfg.rounds)
    if cfg.train.lr_schedule == "cosine":
        return 0.5 * base * (1 + math.cos(math.pi * (server_round - 1) / max(1, total)))
    if cfg.train.lr_schedule == "step":
        return base * float(cfg.train.lr_gamma) ** sum(server_round > f * total for f in cfg.train.lr_step_rounds)
    return base


def sample(seed: int, server_round: int, partitions: int, fraction: float, minimum: int) -> list[int]:
    """The partitions that train in a round (sorted)."""
    k = min(partitions, max(minimum, int(fraction * partitions)))
    rng = np.random.default_rng([seed, server_round, 0])
    return sorted(int(p) for p in rng.choice(np.arange(partitions), size=k, replace=False))


def local_train(
    cfg: DictConfig, spec: dict[str, Any], state: State, dataset: Any, lr: float, seed: int, present: torch.Tensor
) -> State:
    """One client's local epochs from ``state``; returns the trained state."""
    torch.manual_seed(seed)
    model = build_model(spec)
    model.load_state_dict(state)
    model.to(memory_format=torch.channels_last).train()  # PyTorch's layout advice for CNNs on CPU
    t = cfg.train
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=float(t.momentum), weight_decay=float(t.weight_decay)
    )
    loader = DataLoader(
        dataset, batch_size=int(t.batch_size), shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    for _ in range(int(t.local_epochs)):
        for x, y in loader:
            if len(y) < 2:
                continue
            logits = model(x.contiguous(memory_format=torch.channels_last))
            if t.masked_ce:
                logits = logits.masked_fill(~present, 0.0)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if float(t.grad_clip) > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(t.grad_clip))
            optimizer.step()
    return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in model.state_dict().items()}


def fedavg(
    previous: State, states: list[State], counts: list[int], holds: list[np.ndarray], classifier_prefix: str
) -> State:
    """Sample-count-weighted average; classifier rows over the clients holding the class."""
    n = np.asarray(counts, dtype=np.float64)
    w = n / n.sum()
    out: State = {}
    for key, prev in previous.items():
        if key.startswith(f"{classifier_prefix}."):
            rows = []
            for c in range(prev.shape[0]):
                held = [p for p in range(len(states)) if holds[p][c]]
                if not held:
                    rows.append(prev[c].double())
                    continue
                total = sum(w[p] for p in held)
                rows.append(sum((w[p] / total) * states[p][key][c].double() for p in held))
            out[key] = torch.stack(rows).to(prev.dtype)
        elif prev.dtype == torch.float32:  # float32: one weighted sum over the clients, as a server does
            stacked = torch.stack([states[p][key].reshape(-1) for p in range(len(states))])
            out[key] = (torch.as_tensor(w, dtype=torch.float32) @ stacked).view(prev.shape)
        else:
            out[key] = sum(w[p] * states[p][key].double() for p in range(len(states))).to(prev.dtype)
    return out


def run_bare_fedavg(cfg: DictConfig) -> tuple[State, list[dict[str, Any]]]:
    """The whole run; (final global state, one row per round: sampled partitions, lr)."""
    if cfg.method.name != "fedavg" or cfg.method.variant != "full":
        raise ValueError(
            f"method={cfg.method.name} (variant {cfg.method.get('variant')}); "
            "the bare loop mirrors method=fedavg with method.variant=full only"
        )
    torch.set_num_threads(max(1, int(math.floor(float(cfg.simulation.num_cpus)))))
    spec, seed, partitions = model_spec(cfg), int(cfg.seed), int(cfg.num_clients)
    data = data_spec(cfg, partitions)
    torch.manual_seed(seed)
    model = build_model(spec)
    prefix = getattr(model, "classifier_name", "fc")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    datasets = {p: client_dataset(data, p, cfg.dataset.data_dir) for p in range(partitions)}
    history = []
    for server_round in range(1, int(cfg.rounds) + 1):
        lr = round_lr(cfg, server_round)
        picked = sample(seed, server_round, partitions, float(cfg.fraction_train), int(cfg.min_train_nodes))
        states, counts, holds = [], [], []
        for p in picked:
            class_counts = datasets[p].class_counts()
            present = torch.as_tensor(class_counts > 0)
            states.append(local_train(cfg, spec, state, datasets[p], lr, client_seed(seed, server_round, p), present))
            counts.append(len(datasets[p]))
            holds.append(class_counts > 0)
        state = fedavg(state, states, counts, holds, prefix)
        history.append({"round": server_round, "lr": lr, "partitions": picked})
    return state, history


@torch.no_grad()
def test_accuracy(cfg: DictConfig, state: State) -> float:
    """Top-1 accuracy of ``state`` on the test set (batch statistics, as the server evaluates)."""
    model = build_model(model_spec(cfg), spectral_init=False)
    model.load_state_dict(state)
    model.eval()
    loader = DataLoader(test_dataset(data_spec(cfg), cfg.dataset.data_dir), batch_size=int(cfg.evaluation.batch_size))
    correct = seen = 0
    for x, y in loader:
        correct += int((model(x).argmax(1) == y).sum())
        seen += len(y)
    return correct / max(1, seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bare_fedavg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (method=fedavg is implied)")
    parser.add_argument("--save", help="write the final model here (safetensors)")
    args = parser.parse_args(argv)
    cfg = load_config(["method=fedavg", *args.overrides])
    state, history = run_bare_fedavg(cfg)
    for row in history:
        print(f"round {row['round']}: lr {row['lr']:.5f}, partitions {row['partitions']}")
    print(f"final test accuracy {test_accuracy(cfg, state):.4f}")
    if args.save:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
