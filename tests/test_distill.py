"""Self-distillation towards the received model: exactness at weight 0, the loss by hand, the message."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord
from torch.utils.data import TensorDataset

from fedhm_flwr.config import ConfigError, model_spec, run_options
from fedhm_flwr.math.train import TrainOptions, train_local
from fedhm_flwr.models import build_model
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.server.registry import FedHMStrategy

SPEC = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 28, "width": 4}


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def _model(seed=0):
    torch.manual_seed(seed)
    return build_model(SPEC)


def _train(model, data, **options):
    opts = TrainOptions(**{"lr": 0.1, "batch_size": 4, "local_epochs": 2, "weight_decay": 5e-4, **options})
    return train_local(model, data, opts, torch.device("cpu"), seed=3)


def test_weight_zero_gives_exactly_the_plain_training():
    data = _data(12)
    plain, distilled = _model(), _model()
    stats_plain = _train(plain, data)
    stats_zero = _train(distilled, data, distill=True, distill_weight=0.0, distill_temperature=3.0)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), distilled.state_dict().values()))
    assert stats_plain["train-loss"] == stats_zero["train-loss"]
    # and a positive weight does change the training (the term is active)
    other = _model()
    _train(other, data, distill=True, distill_weight=1.0, distill_temperature=3.0)
    assert not all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), other.state_dict().values()))


def _kl_by_hand(teacher_logits, student_logits, t):
    pt = torch.exp(teacher_logits / t) / torch.exp(teacher_logits / t).sum(1, keepdim=True)
    ps = torch.exp(student_logits / t) / torch.exp(student_logits / t).sum(1, keepdim=True)
    return (pt * (pt.log() - ps.log())).sum() / len(pt)


def test_reported_loss_is_ce_plus_weight_t2_kl_by_hand():
    """One batch, two epochs, plain SGD: epoch 1 the student is the teacher (KL = 0), then one
    step, and epoch 2 pays CE + lambda T^2 KL(teacher || student) against the frozen teacher."""
    x, y = _data(6).tensors
    data = TensorDataset(x, y)
    lam, t, lr = 0.7, 2.5, 0.2
    model = _model(1)
    hand = copy.deepcopy(model).train()
    stats = train_local(
        model,
        data,
        TrainOptions(
            lr=lr,
            batch_size=6,
            local_epochs=2,
            momentum=0.0,
            weight_decay=0.0,
            masked_ce=False,
            distill=True,
            distill_weight=lam,
            distill_temperature=t,
        ),
        torch.device("cpu"),
        seed=5,
    )
    teacher_logits = hand(x).detach()
    loss1 = F.cross_entropy(hand(x), y)
    grads = torch.autograd.grad(loss1, list(hand.parameters()))
    with torch.no_grad():
        for p, g in zip(hand.parameters(), grads):
            p -= lr * g
        student_logits = hand(x)
        loss2 = F.cross_entropy(student_logits, y) + lam * t * t * _kl_by_hand(teacher_logits, student_logits, t)
    assert _kl_by_hand(teacher_logits, student_logits, t) > 1e-6  # the teacher stayed frozen
    assert stats["train-loss"] == pytest.approx(float(loss1.detach() + loss2) / 2, rel=1e-5)


def test_distill_options_travel_in_the_train_message(toy_cfg):
    cfg = toy_cfg("train.distill.enabled=true train.distill.temperature=3 train.distill.weight=0.25")
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    grid = LocalGrid(6, client_handlers())
    state = initial_state(cfg.seed, strategy.method.spec)
    messages = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(state), None, grid))
    for msg in messages:
        train = json.loads(msg.content["config"]["train"])
        assert (train["distill"], train["distill_temperature"], train["distill_weight"]) == (True, 3.0, 0.25)
        assert TrainOptions.from_dict(train).distill_weight == 0.25


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.distill.enabled=yes", "train.distill.enabled"),
        ("train.distill.temperature=0", "train.distill.temperature"),
        ("train.distill.weight=-1", "train.distill.weight"),
    ],
)
def test_bad_distill_values_are_refused(toy_cfg, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        toy_cfg(override)
