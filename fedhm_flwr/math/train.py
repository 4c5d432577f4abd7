"""Local training and evaluation loops and their losses. No Flower import.

* Frobenius decay ``lambda/2 * ||A B||_F^2`` on each factorized pair *instead of* weight decay
  (ordinary weight decay stays on the full-rank parameters), ``lambda`` = the weight decay.
* Masked cross-entropy: logits of classes absent from the client's local data are set to 0
  before the loss (training only).
* Static batch norm: the models' norms keep no running statistics, so training normalises with
  batch statistics and nothing about the client's data distribution leaks into the weights sent.
* SGD with momentum, re-created every round at the round's learning rate (on a CPU torch's SGD
  without its wrappers, :mod:`fedhm_flwr.math.sgd`: bit-identical, and no ``torch._dynamo`` import in
  the process; ``optimizer="adamw"``: AdamW instead, the transformer track's choice for LoRA /
  adapters; also re-created every round).
* Self-distillation (FedHM conference paper, non-IID; ``distill``): the teacher is the received
  model, frozen for the local epochs; the loss is ``CE + weight · T² · KL(teacher_T || student_T)``
  on the unmasked logits softened by ``T`` (the reported train loss is this whole loss).
* A method's client hook (``hook``, docs/METHODS.md#client-hooks): the train option ``hook`` names
  a module of :mod:`fedhm_flwr.math` whose ``train_hook(model, hook_options, seed)`` returns the
  step of one batch, ``(x, y, loss) -> (loss, logits)``, used instead of ``model(x)`` and the
  masked cross-entropy (FjORD: ``hook="fjord"``, :mod:`fedhm_flwr.math.fjord`). Without one
  (every other method) the loop is unchanged.
"""

from __future__ import annotations

import copy
import importlib
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedhm_flwr.core.protocol import NUM_EXAMPLES, SECONDS, TRAIN_ACCURACY, TRAIN_LOSS
from fedhm_flwr.math.sgd import MomentumSGD, make_sgd


@dataclass(frozen=True)
class TrainOptions:
    """Everything a client's local training needs; it arrives in the message (a key it does not
    know is refused: :meth:`from_dict`)."""

    lr: float = 0.05
    local_epochs: int = 1
    batch_size: int = 32
    momentum: float = 0.9
    optimizer: str = "sgd"  # "sgd" (with momentum) | "adamw"
    weight_decay: float = 5e-4
    frobenius_decay: bool = False
    masked_ce: bool = True
    grad_clip: float = 0.0
    threads: int = 1
    distill: bool = False
    distill_temperature: float = 2.0
    distill_weight: float = 0.5
    hook: str = ""  # a method's client hook: a module of fedhm_flwr.math with train_hook ("" none)
    hook_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainOptions:
        """The options of a task's train entry; a key that is not an option raises ValueError naming
        it and the allowed keys (the client replies with that error rather than train on guesses)."""
        known = [f.name for f in fields(cls)]
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ValueError(f"unknown train option {unknown[0]!r}; allowed: {known}")
        return cls(**values)


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T² · KL(softmax(teacher/T) || softmax(student/T))``, averaged over the batch."""
    t = float(temperature)
    return (
        t
        * t
        * F.kl_div(
            F.log_softmax(student_logits / t, dim=1),
            F.log_softmax(teacher_logits / t, dim=1),
            reduction="batchmean",
            log_target=True,
        )
    )


def client_hook(name: str, model: nn.Module, options: Mapping[str, Any], seed: int) -> Callable[..., Any]:
    """The per-batch step of the method's client hook ``name``: ``train_hook(model, options, seed)``
    of the module ``fedhm_flwr.math.<name>``; a name that is no such module is refused."""
    module = None
    if re.fullmatch(r"[a-z][a-z0-9_]*", str(name)):
        try:
            module = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError:
            module = None
    hook = getattr(module, "train_hook", None)
    if not callable(hook):
        raise ValueError(
            f"train option hook={name!r}: not a client hook; allowed: the name of a module of "
            f"{__package__} that defines train_hook (e.g. 'fjord'), or '' for none"
        )
    return hook(model, options, seed)


def pick_device() -> torch.device:
    """CUDA when present (the GPU share Ray gave this client), CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LowRankPair(Protocol):
    """What training uses of a module carrying a low-rank pair (fedhm_flwr.models.layers')."""

    def frobenius_sq(self) -> torch.Tensor: ...

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


def factorized_modules(model: nn.Module) -> list[LowRankPair]:
    """Modules that carry a low-rank pair (they expose ``frobenius_sq``)."""
    return cast("list[LowRankPair]", [m for m in model.modules() if hasattr(m, "frobenius_sq")])


def parameter_groups(model: nn.Module, weight_decay: float, frobenius_decay: bool) -> list[dict[str, Any]]:
    """Weight decay on full-rank parameters; none on the factor weights of factorized pairs when
    Frobenius decay is on (their biases are full-rank parameters and keep ordinary weight decay)."""
    low_rank: set[int] = set()
    if frobenius_decay:
        low_rank = {
            id(p) for m in factorized_modules(model) for name, p in m.named_parameters() if not name.endswith("bias")
        }
    decayed = [p for p in model.parameters() if p.requires_grad and id(p) not in low_rank]
    pairs = [p for p in model.parameters() if p.requires_grad and id(p) in low_rank]
    groups = [{"params": decayed, "weight_decay": weight_decay}]
    if pairs:
        groups.append({"params": pairs, "weight_decay": 0.0})
    return groups


def frobenius_penalty(model: nn.Module, weight_decay: float) -> torch.Tensor | float:
    """``lambda/2 * sum ||A B||_F^2`` over the factorized pairs."""
    mods = factorized_modules(model)
    if not mods or weight_decay == 0:
        return 0.0
    return 0.5 * weight_decay * sum(m.frobenius_sq() for m in mods)


def backward(objective: torch.Tensor, model: nn.Module, frobenius_decay: float = 0.0) -> None:
    """``(objective + frobenius_penalty(model, frobenius_decay)).backward()``, with the penalty's
    gradient given in closed form: ``lambda A (B Bᵀ)`` and ``lambda (AᵀA) B`` for each pair's
    ``factors()`` ``(A, B)`` (every ``frobenius_sq`` is ``‖A B‖_F²``). One backward pass; the
    penalty's own graph (about twenty small ops per pair, forward and backward) is never built
    (docs/METHODS.md#fedhm-client-training)."""
    mods = factorized_modules(model) if frobenius_decay else []
    if not mods:
        torch.autograd.backward(objective)  # (objective.backward(), typed)
        return
    tensors: list[torch.Tensor] = [objective]
    grads: list[torch.Tensor | None] = [None]
    for m in mods:
        A, B = m.factors()  # views of the weights: their gradients flow back into the weights
        with torch.no_grad():
            a, b = A.detach(), B.detach()
            grads += [frobenius_decay * (a @ (b @ b.t())), frobenius_decay * ((a.t() @ a) @ b)]
        tensors += [A, B]
    torch.autograd.backward(tensors, grads)


def conv_layout(model: nn.Module, device: torch.device) -> torch.memory_format:
    """``channels_last`` for a model with 2-D convolutions on the CPU (its batch norm, ReLU and
    max-pool run vectorised over channels, several times faster there, and a factorized conv's
    1×k and k×1 halves too: bench figure 3), else contiguous (GPUs: not measured yet).

    Not for a model holding a strided 1×1 convolution of fewer than 8 input channels (a ResNet of
    width 2-6's downsampling): oneDNN's AVX2 kernel for its backward pass in channels_last corrupts
    the heap on CPUs without AVX-512 (torch 2.14; the process aborts), contiguous runs it correctly."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    unsafe = any(m.kernel_size == (1, 1) and max(m.stride) > 1 and m.in_channels < 8 for m in convs)
    return torch.channels_last if convs and not unsafe and device.type == "cpu" else torch.contiguous_format


def mask_absent_classes(logits: torch.Tensor, present: torch.Tensor | None) -> torch.Tensor:
    """Set the logits of classes absent from the local data to 0 (masked cross-entropy)."""
    if present is None:
        return logits
    return logits.masked_fill(~present.to(logits.device), 0.0)


def train_local(
    model: nn.Module,
    dataset: Dataset[Any],
    options: TrainOptions,
    device: torch.device,
    present_classes: torch.Tensor | None = None,
    seed: int = 0,
    loss_extra: Any = None,
) -> dict[str, float]:
    """Train ``model`` in place; returns num-examples, mean loss and accuracy, seconds.

    ``present_classes`` is a boolean mask over classes (the client's label set) for masked
    cross-entropy; ``loss_extra(model, x, logits) -> tensor`` adds a method-specific term.
    """
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(int(seed))
    loader = DataLoader(dataset, batch_size=options.batch_size, shuffle=True, generator=generator, drop_last=False)
    layout = conv_layout(model, device)
    # (Module.to takes a device and a memory format together; torch's overloads name them apart)
    model.to(device, memory_format=layout).train()  # type: ignore[call-overload]
    groups = parameter_groups(model, options.weight_decay, options.frobenius_decay)
    if options.optimizer == "adamw":
        optimizer: torch.optim.Optimizer | MomentumSGD = torch.optim.AdamW(groups, lr=options.lr)
    elif options.optimizer == "sgd":
        optimizer = make_sgd(groups, options.lr, options.momentum, device)  # (torch.optim's without its wrappers)
    else:
        raise ValueError(f"train option optimizer={options.optimizer!r}; allowed: 'sgd', 'adamw'")
    mask = present_classes if options.masked_ce else None
    teacher = _frozen_copy(model) if options.distill else None
    step = client_hook(options.hook, model, options.hook_options, seed) if options.hook else None
    total_loss, correct, seen = 0.0, 0, 0
    for _ in range(options.local_epochs):
        for x, y in loader:
            if len(y) < 2:  # batch norm needs two samples
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if x.ndim == 4:
                x = x.contiguous(memory_format=layout)
            if step is None:
                logits = model(x)
                loss = F.cross_entropy(mask_absent_classes(logits, mask), y)
            else:
                loss, logits = step(x, y, lambda out, target: F.cross_entropy(mask_absent_classes(out, mask), target))
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(x)
                loss = loss + options.distill_weight * distillation_kl(
                    logits, teacher_logits, options.distill_temperature
                )
            objective = loss
            if loss_extra is not None:
                objective = objective + loss_extra(model, x, logits)
            optimizer.zero_grad(set_to_none=True)
            backward(objective, model, options.weight_decay if options.frobenius_decay else 0.0)
            if options.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), options.grad_clip)
            optimizer.step()
            total_loss += float(loss.detach()) * len(y)
            correct += int((logits.detach().argmax(1) == y).sum())
            seen += len(y)
    model.to(memory_format=torch.contiguous_format)  # the state sent back: plain layout
    return {
        NUM_EXAMPLES: len(dataset),  # type: ignore[arg-type]  # map-style: torch's Dataset declares no __len__
        TRAIN_LOSS: total_loss / max(1, seen),
        TRAIN_ACCURACY: correct / max(1, seen),
        SECONDS: time.perf_counter() - t0,
    }


def _frozen_copy(model: nn.Module) -> nn.Module:
    """The received model as a teacher: a copy in the student's mode (same normalisation and
    Scaler behaviour, so it agrees with the student before the first step), no gradients."""
    teacher = copy.deepcopy(model)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def evaluate(model: nn.Module, dataset: Dataset[Any], batch_size: int, device: torch.device) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy (no masking) on ``dataset``."""
    return evaluate_each(model, dataset, batch_size, device, outputs=0)[0]


def evaluate_each(
    model: nn.Module, dataset: Dataset[Any], batch_size: int, device: torch.device, outputs: int
) -> list[dict[str, float]]:
    """:func:`evaluate` of each of the ``outputs`` logits a model's forward returns as a tuple (several
    networks run as one, ``fedhm_flwr.models.batched``); ``outputs=0``: a model returning one tensor."""
    return evaluate_batches(model, DataLoader(dataset, batch_size=batch_size, shuffle=False), device, outputs)


def evaluate_batches(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    outputs: int,
    workers: int | None = None,
) -> list[dict[str, float]]:
    """:func:`evaluate_each` over given ``(inputs, labels)`` batches (a test set cut once and scored
    every round: the batches a DataLoader over it gives, the same figures).

    On a CPU the batches are scored ``workers`` at a time (default: torch's thread count), each in a
    thread of its own with one torch thread, instead of one batch at a time with every kernel split
    over the threads: the same kernels on the same batches, the same values bit for bit (tested), the
    sums added in batch order as before, and a CPU's threads better used on small batched kernels (a
    level's convolutions and norms; bench figure 11 gives evaluation's share of a round). The model's
    forward must not write the model (evaluation mode: the norms read their statistics, none is updated)."""
    model.to(device).eval()
    sums = [[0.0, 0] for _ in range(max(1, outputs))]  # per output: summed loss, correct
    seen = 0

    @torch.no_grad()  # (grad mode is per thread)
    def score(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, list[tuple[float, int]]]:
        x, y = batch[0].to(device), batch[1].to(device)
        logits_each = model(x) if outputs else (model(x),)
        return len(y), [
            (float(F.cross_entropy(logits, y, reduction="sum")), int((logits.argmax(1) == y).sum()))
            for logits in logits_each
        ]

    workers = torch.get_num_threads() if workers is None else workers
    for n, figures in _in_order(score, batches, workers if device.type == "cpu" else 1):
        for total, (loss, correct) in zip(sums, figures, strict=True):
            total[0] += loss
            total[1] += correct
        seen += n
    return [
        {"loss": loss / max(1, seen), "accuracy": correct / max(1, seen), NUM_EXAMPLES: seen} for loss, correct in sums
    ]


def _in_order(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> Iterator[Any]:
    """``map(fn, items)``, ``workers`` items at a time in threads each running torch single-threaded
    (torch's thread count restored after), at most ``2 * workers`` items taken ahead; in the caller's
    thread when ``workers`` <= 1."""
    if workers <= 1:
        yield from map(fn, items)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            ahead: deque[Future[Any]] = deque()
            for item in items:
                ahead.append(pool.submit(fn, item))
                if len(ahead) >= 2 * workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
    finally:
        torch.set_num_threads(threads)
