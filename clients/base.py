"""The client side of every method: receive -> build the described model -> train -> reply.

Clients are told, not configured: the message carries the model spec (architecture, level,
per-layer ranks), the arrays, the training hyperparameters and the data spec. The node itself
only knows where its data is and what it can afford (its node config):

* ``partition-id`` / ``num-partitions``: which partition of the data spec is this node's
  (set by the simulation engine; set them in ``--node-config`` on a real SuperNode);
* ``data-dir``: the folder holding the node's local copy of the dataset (optional);
* ``capability-level`` or ``capability-params`` / ``capability-macs`` / ``capability-memory``:
  what the node declares it can train (optional).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedhm_flwr import attacks
from fedhm_flwr.bn_stats import bn_sums
from fedhm_flwr.data import client_dataset
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import load_federated, trainable_state
from fedhm_flwr.train import TrainOptions, evaluate, pick_device, train_local

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"


def node_partition(context: Context, data_spec: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
    """(partition id, local data folder, data spec with the node's partition count)."""
    node = context.node_config
    if "partition-id" not in node:
        raise ValueError("node config lacks 'partition-id' (set it with --node-config on a SuperNode)")
    spec = dict(data_spec)
    if "num-partitions" in node:
        spec["num_partitions"] = int(node["num-partitions"])
    data_dir = node.get("data-dir") or None
    return int(node["partition-id"]), (str(data_dir) if data_dir else None), spec


def received_model(msg: Message, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the model the message describes and load its arrays (strictly: same keys, shapes; with
    ``trainable_only`` in the spec: exactly the non-backbone keys over the locally loaded backbone)."""
    config = msg.content[CONFIG]
    spec = json.loads(str(config["model-spec"]))
    model = build_model(spec, spectral_init=False)
    state = msg.content[ARRAYS].to_torch_state_dict()
    if spec.get("trainable_only"):
        # frozen backbone loaded by this node itself; the message holds exactly the other tensors
        load_federated(model, state)
    else:
        model.load_state_dict(state, strict=True)
    return model.to(device), spec


def local_dataset(config: ConfigRecord, context: Context, augment: bool = True) -> Any:
    """This node's partition of the dataset the message's data spec names."""
    pid, data_dir, data_spec = node_partition(context, json.loads(str(config["data-spec"])))
    return client_dataset(data_spec if augment else {**data_spec, "augment": False}, pid, data_dir)


class InjectedFailure(RuntimeError):
    """A failure the server asked for (``failures.*`` in the config), to test robustness."""


def obey_injection(config: ConfigRecord) -> None:
    """Crash or stall when the server's failure injection says so."""
    what = str(config.get("inject", ""))
    if what == "crash":
        raise InjectedFailure("injected client crash")
    if what == "slow":
        time.sleep(float(config.get("inject-seconds", 0.0)))


def handle_train(msg: Message, context: Context) -> Message:
    """Train the received model on the node's partition and reply with arrays and metrics."""
    config = msg.content[CONFIG]
    obey_injection(config)
    options = TrainOptions.from_dict(json.loads(str(config["train"])))
    torch.set_num_threads(max(1, int(options.threads)))
    torch.manual_seed(int(config["seed"]))
    device = pick_device()
    model, spec = received_model(msg, device)
    dataset = local_dataset(config, context)
    attack = str(config.get("attack", "none"))  # the server's attack injection (failures.attack)
    if attack == "label_flip":
        dataset = attacks.LabelFlipped(dataset, int(spec["num_classes"]))
    counts = dataset.class_counts()
    present = torch.as_tensor(counts > 0)
    stats = train_local(model, dataset, options, device, present_classes=present, seed=int(config["seed"]))
    metrics = MetricRecord({
        "num-examples": int(stats["num-examples"]),
        "train-loss": float(stats["train-loss"]),
        "train-accuracy": float(stats["train-accuracy"]),
        "seconds": float(stats["seconds"]),
        "level": float(config["level"]),
        "class-counts": [int(c) for c in counts],
    })
    if spec.get("trainable_only"):  # only what this client trained travels back
        state = trainable_state(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if attack in attacks.UPDATE_ATTACKS:
        received = msg.content[ARRAYS].to_torch_state_dict()
        state = attacks.tamper(attack, received, state, float(config.get("attack-scale", 1.0)), int(config["seed"]))
    arrays = ArrayRecord.from_torch_state_dict(state)
    return Message(RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=msg)


def _model_over_local_data(msg: Message, context: Context) -> tuple[torch.nn.Module, Any, torch.device]:
    """The received model and this node's partition without augmentation (evaluation passes)."""
    device = pick_device()
    model, _ = received_model(msg, device)
    return model, local_dataset(msg.content[CONFIG], context, augment=False), device


def handle_evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the node's local partition (federated evaluation)."""
    model, dataset, device = _model_over_local_data(msg, context)
    stats = evaluate(model, dataset, int(msg.content[CONFIG].get("batch-size", 256)), device)
    metrics = MetricRecord({"num-examples": int(stats["num-examples"]), "eval-loss": float(stats["loss"]),
                            "eval-accuracy": float(stats["accuracy"])})
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)


def node_info(context: Context) -> ConfigRecord:
    """The node config the server may know: partition and declared capability."""
    node = context.node_config
    out: dict[str, Any] = {}
    for key in ("partition-id", "num-partitions"):
        if key in node:
            out[key] = int(node[key])
    if node.get("node-name"):
        out["node-name"] = str(node["node-name"])
    for key, value in node.items():
        if key.startswith("capability-"):
            out[key] = float(value)
    return ConfigRecord(out)


def bn_statistics(msg: Message, context: Context) -> RecordDict:
    """Per-layer input sums of the received model over this node's training data (sBN)."""
    model, dataset, device = _model_over_local_data(msg, context)
    sums = bn_sums(model, dataset, int(msg.content[CONFIG].get("batch-size", 64)), device)
    return RecordDict({ARRAYS: ArrayRecord.from_torch_state_dict({k: v.float() for k, v in sums.items()})})


QUERIES = {
    "node-info": lambda msg, context: RecordDict({CONFIG: node_info(context)}),
    "bn-stats": bn_statistics,
}


def handle_query(msg: Message, context: Context) -> Message:
    """Answer the server's questions about this node (``config['query']`` names which)."""
    what = str(msg.content[CONFIG]["query"])
    if what not in QUERIES:
        raise ValueError(f"unknown query {what!r}; known: {sorted(QUERIES)}")
    return Message(QUERIES[what](msg, context), reply_to=msg)

