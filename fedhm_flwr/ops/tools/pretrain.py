"""Pre-train the ViT backbones of the image transformer track, and measure what pre-training buys.

``python -m fedhm_flwr.ops.tools.pretrain vit`` (``make pretrain``) trains the three ViT sizes (widths 64,
32, 16; depth 4, 2 heads, patch 7, MLP ratio 2) centrally on a *source task*: Fashion-MNIST's
training images of classes 0-4 only (T-shirt/top, trouser, pullover, dress, coat; about 30k
images), a few epochs of AdamW on the CPU (minutes). The federated task then uses all ten
classes, so five of them are never seen in pre-training and the test set never is. Each backbone
(every tensor but the 5-class head) goes to ``$FEDHM_CACHE/vit/<name>.safetensors`` (default
``~/.cache/fedhm-flwr/vit/``; never in the repository), with the architecture, the source
classes, the epochs and the source accuracy in its metadata; the model specs name the file
(``cache:vit/<name>``), every node loads its own copy.

``python -m fedhm_flwr.ops.tools.pretrain probe`` reports the frozen-backbone (linear probe) accuracy of
the pre-trained versus a random backbone of the same architecture: a logistic-regression head
trained on frozen features of a seeded training subset, evaluated on the test set. For the
text track it compares the packaged MiniLM with a random BERT of the same shape on the
``sentiment`` task; for the image track every pre-trained ViT size with a random one (all ten
Fashion-MNIST classes). ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from fedhm_flwr.data import DATASETS, client_dataset, load_arrays, make_data_spec, test_dataset, to_normalised_tensor
from fedhm_flwr.models import build_model
from fedhm_flwr.models.text import PACKAGE_BACKBONE
from fedhm_flwr.models.vit import (
    DEFAULTS,
    arch_of,
    backbone_keys,
    cache_dir,
    checkpoint_name,
    checkpoint_ref,
    new_vit,
)

SOURCE_CLASSES = (0, 1, 2, 3, 4)
WIDTHS = (64, 32, 16)


def _fmnist(split: str) -> tuple[Tensor, Tensor]:
    """Normalised Fashion-MNIST ``(N, 1, 28, 28)`` float32 and int64 labels."""
    images, labels = load_arrays("fashion_mnist", split)
    return to_normalised_tensor(images, DATASETS["fashion_mnist"]), torch.from_numpy(labels.copy())


def vit_spec(width: int, num_classes: int = 10) -> dict[str, Any]:
    return {"arch": "vit", "num_classes": num_classes, "in_channels": 1, "image_size": 28, **DEFAULTS, "width": width}


def pretrain_vit(
    width: int,
    epochs: int = 3,
    source: Sequence[int] = SOURCE_CLASSES,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 1e-3,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Train one ViT size on the source classes and save its backbone; returns the file."""
    x, y = _fmnist("train")
    keep = torch.isin(y, torch.tensor(list(source)))
    x, y = x[keep], y[keep]
    remap = torch.full((10,), -1, dtype=torch.int64)
    remap[torch.tensor(list(source))] = torch.arange(len(source))
    y = remap[y]
    spec = vit_spec(width, num_classes=len(source))
    model = new_vit(spec, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * math.ceil(len(y) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(y), generator=gen)
        total, correct = 0.0, 0
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            logits = model(x[idx])
            loss = F.cross_entropy(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
        log(
            f"vit width {width}: epoch {epoch + 1}/{epochs} loss {total / len(y):.4f} "
            f"source-train acc {correct / len(y):.4f} ({time.perf_counter() - t0:.0f}s)"
        )
    xt, yt = _fmnist("test")
    keep = torch.isin(yt, torch.tensor(list(source)))
    source_acc = _accuracy(model, xt[keep], remap[yt[keep]])
    log(f"vit width {width}: source-test acc {source_acc:.4f}")
    arch = arch_of(spec)
    folder = out_dir if out_dir is not None else cache_dir() / "vit"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / checkpoint_name(arch)
    meta = {k: str(v) for k, v in arch.items()}
    meta.update(
        {
            "source_classes": ",".join(map(str, source)),
            "epochs": str(epochs),
            "seed": str(seed),
            "source_test_accuracy": f"{source_acc:.4f}",
            "dataset": "fashion_mnist",
        }
    )
    state = model.state_dict()
    tmp = path.with_suffix(".tmp")
    save_file({k: state[k].contiguous() for k in backbone_keys(model)}, str(tmp), metadata=meta)
    tmp.replace(path)
    log(f"saved {path}")
    return path


@torch.no_grad()
def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = sum(int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()) for i in range(0, len(y), batch))
    return correct / len(y)


# ------------------------------------------------------------------------------------ probes


class _Featured(Protocol):
    def features(self, x: Tensor) -> Tensor: ...


@torch.no_grad()
def features(model: nn.Module, x: Tensor, batch: int = 500) -> Tensor:
    """Frozen features (``model.features``) of ``x``, in batches."""
    model.eval()
    backbone = cast(_Featured, model)  # a ViT or text model (torch types a module's own attributes as Tensor | Module)
    return torch.cat([backbone.features(x[i : i + batch]) for i in range(0, len(x), batch)])


def linear_probe(
    train_f: Tensor,
    train_y: Tensor,
    test_f: Tensor,
    test_y: Tensor,
    num_classes: int,
    steps: int = 300,
    weight_decay: float = 1e-4,
) -> float:
    """Test accuracy of a logistic-regression head on frozen features (standardised, full-batch L-BFGS)."""
    mean, std = train_f.mean(0), train_f.std(0).clamp_min(1e-6)
    a, b = (train_f - mean) / std, (test_f - mean) / std
    head = nn.Linear(a.shape[1], num_classes)
    opt = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(head(a), train_y) + weight_decay * head.weight.pow(2).sum()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]  # torch leaves LBFGS.step untyped
    with torch.no_grad():
        return float((head(b).argmax(1) == test_y).float().mean())


def probe_vit(widths: Sequence[int] = WIDTHS, train_size: int = 10000, seed: int = 0) -> list[dict[str, Any]]:
    """Linear-probe accuracy on all ten Fashion-MNIST classes: pre-trained vs random ViT backbones."""
    x, y = _fmnist("train")
    pick = torch.from_numpy(np.random.default_rng(seed).choice(len(y), size=min(train_size, len(y)), replace=False))
    x, y = x[pick], y[pick]
    xt, yt = _fmnist("test")
    rows = []
    for width in widths:
        spec = vit_spec(width)
        for name, backbone in (("pre-trained", checkpoint_ref(arch_of(spec))), ("random", "random")):
            model = build_model({**spec, "backbone": backbone, "backbone_seed": seed})
            acc = linear_probe(features(model, x), y, features(model, xt), yt, 10)
            rows.append(
                {
                    "track": "image",
                    "model": f"ViT width {width}",
                    "backbone": name,
                    "probe_accuracy": acc,
                    "train_examples": len(y),
                    "test_examples": len(yt),
                }
            )
    return rows


def probe_minilm(train_size: int = 2000, test_size: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Linear-probe accuracy on ``sentiment``: the packaged MiniLM vs a random BERT of its shape."""
    spec = make_data_spec("sentiment", 1, seed=seed, max_train_examples=train_size, max_test_examples=test_size)
    train, test = client_dataset(spec, 0), test_dataset(spec)
    rows = []
    for name, backbone in (("pre-trained", PACKAGE_BACKBONE), ("random", "random")):
        model = build_model({"arch": "minilm", "num_classes": 2, "backbone": backbone, "backbone_seed": seed})
        acc = linear_probe(
            features(model, train.ids, 250), train.labels, features(model, test.ids, 250), test.labels, 2
        )
        rows.append(
            {
                "track": "text",
                "model": "MiniLM-L6",
                "backbone": name,
                "probe_accuracy": acc,
                "train_examples": len(train),
                "test_examples": len(test),
            }
        )
    majority = float(max(test.class_counts()) / len(test))
    rows.append(
        {
            "track": "text",
            "model": "(majority class)",
            "backbone": "-",
            "probe_accuracy": majority,
            "train_examples": len(train),
            "test_examples": len(test),
        }
    )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| track | model | backbone | frozen-backbone (linear probe) accuracy | train / test examples |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['track']} | {r['model']} | {r['backbone']} | {100 * r['probe_accuracy']:.2f} % | "
            f"{r['train_examples']} / {r['test_examples']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedhm_flwr.ops.tools.pretrain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("vit", help="pre-train the ViT backbones into the cache")
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder (default $FEDHM_CACHE/vit)")
    q = sub.add_parser("probe", help="frozen-backbone accuracy, pre-trained vs random")
    q.add_argument("--track", choices=("text", "image", "both"), default="both")
    q.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    q.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "vit":
        for width in args.widths:
            pretrain_vit(width, epochs=args.epochs, seed=args.seed, out_dir=args.out)
        return 0
    rows = []
    if args.track in ("text", "both"):
        rows += probe_minilm()
    if args.track in ("image", "both"):
        rows += probe_vit(args.widths)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
