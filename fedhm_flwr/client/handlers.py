"""The client side of every method: receive -> build the described model -> train -> reply.

Clients are told, not configured: the message carries the model spec (architecture, level,
per-layer ranks), the arrays, the training hyperparameters and the data spec. The node itself
only knows where its data is and what it can afford (its node config):

* ``data-dir``: the node's **shard** (a folder holding ``manifest.json``, written by
  ``python -m fedhm_flwr.ops.deploy.shard_export``, see ``docs/DEPLOY.md``): the node trains on its ``train``
  split, evaluates on its ``heldout`` split and never looks for any other data;
* or ``partition-id`` / ``num-partitions``: which partition of the data spec is this node's
  (set by the simulation engine), cut out of a full local copy of the dataset in ``data-dir``
  (optional; default: ``$FEDHM_DATA_DIR`` / the system copy);
* ``node-name``: a stable name for the node (optional, reported to the server);
* ``capability-level`` or ``capability-params`` / ``capability-macs`` / ``capability-memory``:
  what the node declares it can train (optional).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.supercore import log
from torch.utils.data import Subset

from fedhm_flwr.client import hostile
from fedhm_flwr.core import bn_wire, protocol
from fedhm_flwr.data import client_dataset, client_size, shards
from fedhm_flwr.math import attacks
from fedhm_flwr.math.bn_stats import bn_sums
from fedhm_flwr.math.train import TrainOptions, evaluate, pick_device, train_local
from fedhm_flwr.models import build_model
from fedhm_flwr.models.adapters import load_federated, trainable_state
from fedhm_flwr.reporting.startup import process_started_at

ARRAYS, CONFIG, METRICS = protocol.ARRAYS, protocol.CONFIG, protocol.METRICS  # the one wire contract
#: the error code of the replies a node sends when its data cannot serve the request
NODE_DATA_ERROR = 2  # flwr ErrorCode.CLIENT_APP_RAISED_EXCEPTION, the code of any failing ClientApp
#: when this process started and when it had imported the ClientApp (this module, torch and the project
#: with it): a simulated node's start-up marks (:func:`node_info_reply`)
PROCESS_STARTED_AT, IMPORTED_AT = process_started_at(), time.time()


class NodeDataError(ValueError):
    """The node's data (its shard or partition) cannot serve the request; the message says the fix."""


def node_shard(context: Context) -> Path | None:
    """The node's shard folder, or None when the node cuts a partition out of a full dataset copy.

    ``data-dir`` is a shard when it holds ``manifest.json``; without ``partition-id`` it must be
    one (NodeDataError naming ``data-dir`` and the fix otherwise).
    """
    node = context.node_config
    data_dir = str(node.get(protocol.DATA_DIR) or "")
    if data_dir and (Path(data_dir).expanduser() / shards.MANIFEST).is_file():
        return Path(data_dir).expanduser()
    if protocol.PARTITION_ID in node:
        return None
    if not data_dir:
        raise NodeDataError(
            "node config lacks data-dir: set data-dir=<this node's shard folder> (written by "
            "`python -m fedhm_flwr.ops.deploy.shard_export <overrides> out=DIR`) in --node-config"
        )
    raise NodeDataError(
        f"node config data-dir={data_dir}: no shard there (no {shards.MANIFEST}); point data-dir "
        f"at this node's shard folder (e.g. DIR/partition-0 written by `python -m "
        f"fedhm_flwr.ops.deploy.shard_export <overrides> out=DIR`), or give partition-id with a full dataset copy"
    )


def shard_manifest(folder: Path, data_spec: dict[str, Any] | None = None, verify: bool = False) -> dict[str, Any]:
    """The shard's manifest (``verify``: the whole shard checked against it); NodeDataError naming
    ``data-dir`` when it is broken or names another dataset than the server's data spec."""
    try:
        manifest = shards.verify_shard(folder) if verify else shards.read_manifest(folder)
    except shards.ShardError as exc:
        raise NodeDataError(f"node config data-dir={folder}: {exc}") from None
    if data_spec is not None:
        check_shard_dataset(folder, manifest, data_spec)
    return manifest


def check_shard_dataset(folder: Path, manifest: dict[str, Any], data_spec: dict[str, Any]) -> None:
    """NodeDataError naming ``data-dir`` when the shard holds another dataset than the data spec's."""
    if manifest["dataset"] != data_spec.get("name"):
        raise NodeDataError(
            f"node config data-dir={folder}: the shard holds {manifest['dataset']!r}, the server's "
            f"run uses dataset.name={data_spec.get('name')!r}; give this node a shard of that dataset"
        )


def node_partition(context: Context, data_spec: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
    """(partition id, local data folder, data spec with the node's partition count)."""
    node = context.node_config
    if protocol.PARTITION_ID not in node:
        raise ValueError("node config lacks 'partition-id' (set it with --node-config on a SuperNode)")
    spec = dict(data_spec)
    if protocol.NUM_PARTITIONS in node:
        spec["num_partitions"] = int(node[protocol.NUM_PARTITIONS])
    data_dir = node.get(protocol.DATA_DIR) or None
    return int(node[protocol.PARTITION_ID]), (str(data_dir) if data_dir else None), spec


def received_model(msg: Message, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the model the message describes and load its arrays (strictly: same keys, shapes; with
    ``trainable_only`` in the spec: exactly the non-backbone keys over the locally loaded backbone)."""
    spec = json.loads(str(msg.content[CONFIG][protocol.MODEL_SPEC]))
    return load_model(spec, received_state(msg), device), spec


def load_model(spec: dict[str, Any], state: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    """The model ``spec`` describes with ``state`` loaded (see :func:`received_model`), on ``device``."""
    model = build_model(spec, spectral_init=False)
    if spec.get("trainable_only"):
        # frozen backbone loaded by this node itself; the message holds exactly the other tensors
        load_federated(model, state)
    else:
        model.load_state_dict(state, strict=True)
    return model.to(device)


def wire_dtype(msg: Message) -> str:
    """The dtype arrays travel in both ways (the server's ``wire.dtype``; absent: float32)."""
    return str(msg.content[CONFIG].get(protocol.WIRE_DTYPE, "float32"))


def received_state(msg: Message, record: str = ARRAYS) -> dict[str, torch.Tensor]:
    """The arrays of the message's record ``record`` in float32 (clients train in float32 whatever
    the wire dtype)."""
    arrays = cast(ArrayRecord, msg.content[record])  # the server puts arrays under every record name asked for
    return protocol.from_wire(arrays.to_torch_state_dict(), wire_dtype(msg))


def local_dataset(config: Mapping[str, Any], context: Context, augment: bool = True, split: str = "train") -> Any:
    """One split ("train" | "heldout") of this node's data: its shard when ``data-dir`` is one, else its
    partition of the dataset the message's data spec names."""
    data_spec = json.loads(str(config[protocol.DATA_SPEC]))
    augment = augment and bool(data_spec.get("augment", False))
    folder = node_shard(context)
    if folder is not None:
        shard_manifest(folder, data_spec)
        try:
            return shards.load_shard(folder, split, augment)
        except shards.ShardError as exc:
            raise NodeDataError(f"node config data-dir={folder}: {exc}") from None
    pid, data_dir, data_spec = node_partition(context, data_spec)
    return client_dataset({**data_spec, "augment": augment}, pid, data_dir, split)


def data_error(msg: Message, exc: Exception) -> Message:
    """The error reply of a node whose data cannot serve ``msg``."""
    return Message(Error(code=NODE_DATA_ERROR, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)


class InjectedFailure(RuntimeError):
    """A failure the server asked for (``failures.*`` in the config), to test robustness."""


def obey_injection(config: Mapping[str, Any]) -> None:
    """Crash or stall when the server's failure injection says so."""
    what = str(config.get(protocol.INJECT, ""))
    if what == "crash":
        raise InjectedFailure("injected client crash")
    if what == "slow":
        time.sleep(float(config.get(protocol.INJECT_SECONDS, 0.0)))


def ray_node_id() -> str | None:
    """The id of the Ray node this client runs on (Flower's Ray simulation engine), None outside Ray."""
    ray = sys.modules.get("ray")  # never imported here: a deployed node has no Ray
    if ray is None or not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


def handle_train(msg: Message, context: Context) -> Message:
    """Train the received model on the node's partition and reply with arrays and metrics."""
    config: Mapping[str, Any] = msg.content[CONFIG]  # a ConfigRecord: the values the server wrote
    obey_injection(config)
    options = TrainOptions.from_dict(json.loads(str(config[protocol.TRAIN])))
    torch.set_num_threads(max(1, int(options.threads)))
    torch.manual_seed(int(config[protocol.SEED]))
    device = pick_device()
    model, spec = received_model(msg, device)
    dataset = local_dataset(config, context)
    attack = str(config.get(protocol.ATTACK, "none"))  # the server's attack injection (failures.attack)
    if attack == "label_flip":
        dataset = attacks.LabelFlipped(dataset, int(spec["num_classes"]))
    counts = dataset.class_counts()
    present = torch.as_tensor(counts > 0)
    stats = train_local(model, dataset, options, device, present_classes=present, seed=int(config[protocol.SEED]))
    metrics = protocol.train_metrics(
        stats[protocol.NUM_EXAMPLES],
        stats[protocol.TRAIN_LOSS],
        stats[protocol.TRAIN_ACCURACY],
        stats[protocol.SECONDS],
        float(config[protocol.LEVEL]),
        counts,
        ray_node_id(),
    )
    if spec.get("trainable_only"):  # only what this client trained travels back
        state = trainable_state(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if attack in attacks.UPDATE_ATTACKS:
        received = received_state(msg)
        state = attacks.tamper(
            attack, received, state, float(config.get(protocol.ATTACK_SCALE, 1.0)), int(config[protocol.SEED])
        )
    dtype = wire_dtype(msg)  # the reply travels in the wire dtype too
    arrays = ArrayRecord.from_array_dict({k: protocol.wire_array(v, dtype) for k, v in state.items()})
    content = RecordDict({ARRAYS: arrays, METRICS: metrics})
    if attack == "malformed":  # a hostile device: the honest reply, malformed (fedhm_flwr.client.hostile)
        rng = np.random.default_rng(int(config[protocol.SEED]))
        content = hostile.malformed(content, str(config.get(protocol.ATTACK_MALFORMED, "random")), rng)
    return Message(content, reply_to=msg)


def _model_over_local_data(
    msg: Message, context: Context, split: str = "train"
) -> tuple[torch.nn.Module, Any, torch.device]:
    """The received model and one split of this node's data without augmentation (evaluation passes)."""
    dataset = local_dataset(msg.content[CONFIG], context, augment=False, split=split)
    device = pick_device()
    model, _ = received_model(msg, device)
    return model, dataset, device


def handle_evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the node's held-out examples (federated evaluation); an error
    reply when the node has none or its data is broken."""
    try:
        model, dataset, device = _model_over_local_data(msg, context, split="heldout")
        if len(dataset) == 0:
            raise NodeDataError(
                "this node has no held-out examples to evaluate on: run with evaluation.where="
                "clients|both and evaluation.holdout > 0 (a shard: export it with those settings)"
            )
    except NodeDataError as exc:
        return data_error(msg, exc)
    config: Mapping[str, Any] = msg.content[CONFIG]  # a ConfigRecord: the values the server wrote
    stats = evaluate(model, dataset, int(config.get(protocol.BATCH_SIZE, 256)), device)
    metrics = protocol.eval_metrics(stats[protocol.NUM_EXAMPLES], stats["loss"], stats["accuracy"])
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)


def node_info(context: Context, data_spec: dict[str, Any] | None = None) -> ConfigRecord:
    """What the server may know of the node: partition (from its shard's manifest when it has one),
    ``node-name``, declared capability and, when the query carries the run's data spec, how many
    training examples the node holds for it. A node given a ``data-dir`` without a ``partition-id``
    checks its shard completely here (the first message a node gets): NodeDataError naming
    ``data-dir`` and the fix when it is missing, broken or of another dataset; a simulated node
    finds its partition here, so a node whose data cannot serve the run sits out from the start
    (and the data is loaded once, before the first round, not during it). A node with neither
    still answers (identity only); its first training message gets that error."""
    node = context.node_config
    folder = node_shard(context) if node.get(protocol.DATA_DIR) or protocol.PARTITION_ID in node else None
    examples = None
    if folder is not None:
        manifest = shard_manifest(folder, data_spec, verify=True)
        if data_spec is not None:
            examples = int(manifest["splits"]["train"]["num_examples"])
        pid, count = manifest.get("partition_id"), manifest.get("num_partitions")
    else:
        pid, count = node.get(protocol.PARTITION_ID), node.get(protocol.NUM_PARTITIONS)
        if data_spec is not None and pid is not None:
            partition, data_dir, spec = node_partition(context, data_spec)
            examples = client_size(spec, partition, data_dir)
    info = protocol.NodeInfo(
        partition_id=None if pid is None else int(pid),
        num_partitions=None if count is None else int(count),
        name=str(node[protocol.NODE_NAME]) if node.get(protocol.NODE_NAME) else None,
        capability={
            k[len(protocol.CAPABILITY) :]: float(v) for k, v in node.items() if k.startswith(protocol.CAPABILITY)
        },
        examples=examples,
    )
    return info.encode()


def query_data_spec(msg: Message) -> dict[str, Any] | None:
    """The run's data spec a query carries (None when it carries none)."""
    spec = msg.content[CONFIG].get(protocol.DATA_SPEC)
    return None if spec is None else json.loads(str(spec))


def bn_statistics(msg: Message, context: Context) -> RecordDict:
    """Per-layer input sums of each received model over this node's training split (sBN; at most the
    query's ``bn-examples`` of them, a subset drawn with its seed), the data loaded once: model i
    (spec ``model-specs[i]``, arrays in record ``arrays.i``) -> its sums in the reply's record
    ``arrays.i`` (:func:`fedhm_flwr.core.bn_wire.bn_record`)."""
    config: Mapping[str, Any] = msg.content[CONFIG]  # a ConfigRecord: the values the server wrote
    specs = [json.loads(str(spec)) for spec in config[protocol.MODEL_SPECS]]
    dataset = local_dataset(config, context, augment=False)
    cap = int(config.get(protocol.BN_EXAMPLES, 0))
    if 0 < cap < len(dataset):  # a seeded subset: statistics settle long before every example counts
        rng = np.random.default_rng(int(config.get(protocol.SEED, 0)))
        dataset = Subset(dataset, np.sort(rng.choice(len(dataset), cap, replace=False)).tolist())
    device = pick_device()
    batch_size = int(config.get(protocol.BATCH_SIZE, 64))
    out = RecordDict()
    for index, spec in enumerate(specs):
        name = bn_wire.bn_record(index)
        model = load_model(spec, received_state(msg, name), device)
        sums = bn_sums(model, dataset, batch_size, device)
        out[name] = ArrayRecord.from_torch_state_dict({k: v.float() for k, v in sums.items()})
    return out


#: whether this process told its start-up marks already (the first answer of a worker process does)
_MARKS_TOLD: list[bool] = []


def node_info_reply(msg: Message, context: Context) -> RecordDict:
    """The node-info answer; a simulated node (under Ray, on the server's machine and clock) adds its
    start-up marks as metrics (when its worker process started, imported the ClientApp, answered), the
    first answer of each worker process only: the run's summary tells where the seconds before round 1
    went (``fedhm_flwr.reporting.startup``)."""
    reply = RecordDict({CONFIG: node_info(context, query_data_spec(msg))})
    if not _MARKS_TOLD and ray_node_id() is not None:
        reply[METRICS] = protocol.worker_marks(PROCESS_STARTED_AT, IMPORTED_AT, time.time())
        _MARKS_TOLD.append(True)
    return reply


QUERIES = {
    protocol.NODE_INFO: node_info_reply,
    protocol.BN_STATS: bn_statistics,
}


def handle_query(msg: Message, context: Context) -> Message:
    """Answer the server's questions about this node (``config['query']`` names which)."""
    what = str(msg.content[CONFIG][protocol.QUERY])
    if what not in QUERIES:
        raise ValueError(f"unknown query {what!r}; known: {sorted(QUERIES)}")
    try:
        return Message(QUERIES[what](msg, context), reply_to=msg)
    except NodeDataError as exc:
        if what == protocol.NODE_INFO:  # the device owner sees why, in the SuperNode's own log
            log(WARNING, "this node sits out of the run: %s", " ".join(str(exc).split()))
        return data_error(msg, exc)
