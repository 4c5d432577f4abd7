"""Capability-declared levels and credentials of a deployment: the memory estimate, level costs, the
budget -> level mapping through the in-process grid, node-config files and capability specs read by
Flower's own parser, and the credentials chain (fast; the deployments themselves: tests/test_deploy.py).
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.app import ArrayRecord
from flwr.common.config import parse_config_args
from omegaconf import OmegaConf
from test_deploy import TOY, _expected_level

from fedhm_flwr.config import load_config, model_spec, run_options
from fedhm_flwr.models.costs import activation_elements, training_memory_bytes
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.ops.deploy import loopback as dl
from fedhm_flwr.ops.deploy.credentials import create_credentials
from fedhm_flwr.server.registry import FedHMStrategy

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- fast


def test_memory_estimate_counts_weights_gradients_momentum_and_activations():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model.train()
    assert activation_elements(model, (4,)) == 3 + 3 + 2  # outputs of the three leaf modules
    assert model.training  # mode restored
    params = 4 * 3 + 3 + 3 * 2 + 2
    assert training_memory_bytes(params, 8, batch_size=10) == 4 * (3 * params + 10 * 8)
    assert training_memory_bytes(params, 8, batch_size=10, optimizer_slots=0) == 4 * (2 * params + 10 * 8)


def test_fedhm_level_costs_include_memory_that_follows_the_config():
    cfg = load_config(TOY)
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    costs = [strategy.method.level_cost(i) for i in range(len(strategy.levels))]
    assert all(c["memory"] > 4 * 3 * c["params"] for c in costs)  # weights + grads + momentum + activations
    assert costs[-1]["memory"] < costs[0]["memory"]
    bigger = FedHMStrategy(run_options(OmegaConf.merge(cfg, {"train": {"batch_size": 64}})), model_spec(cfg))
    no_momentum = FedHMStrategy(run_options(OmegaConf.merge(cfg, {"train": {"momentum": 0.0}})), model_spec(cfg))
    for i, c in enumerate(costs):
        acts = (bigger.method.level_cost(i)["memory"] - c["memory"]) / (4 * (64 - 32))  # activations per input
        assert acts == int(acts) > 0
        assert c["memory"] - no_momentum.method.level_cost(i)["memory"] == 4 * c["params"]  # one momentum buffer


def test_declared_budgets_map_to_the_largest_fitting_level_and_silence_to_the_default():
    cfg = load_config(TOY + ["num_clients=5", "levels.default=0.125"])
    strategy = FedHMStrategy(run_options(cfg), model_spec(cfg))
    cost = lambda i, kind: strategy.method.level_cost(i)[kind]  # noqa: E731
    declared = {
        0: {"capability-memory": (cost(1, "memory") + cost(2, "memory")) / 2},
        1: {"capability-macs": (cost(0, "macs") + cost(1, "macs")) / 2},
        2: {"capability-params": cost(3, "params") / 2},  # fits nothing: the smallest level
        3: {"capability-level": 1.0},
        4: {},  # declares nothing: levels.default
    }
    grid = LocalGrid(5, client_handlers(), node_config=lambda i: declared[i])
    msgs = list(
        strategy.configure_train(
            1, ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, strategy.method.spec)), None, grid
        )
    )
    got = {strategy.nodes[m.metadata.dst_node_id].partition_id: m.content["config"]["level"] for m in msgs}
    assert got[0] == _expected_level(strategy, "memory", declared[0]["capability-memory"])
    assert got[1] == _expected_level(strategy, "macs", declared[1]["capability-macs"]) == 0.5
    assert got[2] == 0.125 and got[3] == 1.0 and got[4] == 0.125
    assert strategy.round_log.assignments == {f"p{k}": v for k, v in got.items()}  # what metrics.jsonl records


def test_capability_specs_and_node_config_files_round_trip_through_flowers_parser(tmp_path):
    assert dl.parse_capability("level=0.5") == {"capability-level": 0.5}
    assert dl.parse_capability("memory=64M") == {"capability-memory": 64e6}
    assert dl.parse_capability("macs=4e5") == {"capability-macs": 4e5}
    assert dl.parse_capability("-") == {}
    for bad in ("speed=3", "params", "params=abc", "level=0"):
        with pytest.raises(ValueError):
            dl.parse_capability(bad)
    config = dl.node_config(3, 8, {"capability-params": 2e4}, "/data/dev ice 3")
    path = tmp_path / "node-config.toml"
    path.write_text(dl.node_config_toml(config))
    assert parse_config_args([str(path)]) == config  # what flower-supernode --node-config FILE reads


def test_credentials_form_a_chain_and_keys_are_what_flower_reads(tmp_path):
    creds = create_credentials(tmp_path, ["node-0"], sans=["localhost", "127.0.0.1", "10.1.2.3"])
    ca = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate((creds.server_dir / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    node = creds.node_dir("node-0")
    private = load_ssh_private_key((node / "node.key").read_bytes(), None)
    public = load_ssh_public_key((node / "node.pub").read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert private.public_key().public_numbers() == public.public_numbers()
    assert (node / "ca.pem").read_bytes() == creds.ca_cert.read_bytes()
    for secret in (creds.ca_key, creds.server_dir / "server.key", node / "node.key"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600


# --------------------------------------------------------------------------- slow


#: the TLS test's job: TOY over 2 rounds. The SuperLink is stopped in round 2, once both devices' ClientApps are
#: busy with its training (a node polls every 3 s when idle, then starts a ClientApp process that takes seconds to
#: import torch and train; the test's SIGTERM follows within 0.1 s). No deployment statistics after
#: the last round (one more query to every node, all levels in it, a ClientApp process each; nothing of an
#: export is checked here, tests/test_deploy_docs.py exports)
