"""A run's options are parsed once into frozen, typed objects (``fedhm_flwr.config.options.run``): a
key no section knows is refused where users meet the config, a resumed run's old config gets today's
defaults, a check does not rewrite the config, and a client refuses a train option it does not know
with an error reply while the round goes on."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from flwr.app import ArrayRecord, MessageType
from omegaconf import OmegaConf

from fedhm_flwr.config import ConfigError, compose_config, load_config, model_spec, resume_config, run_options, validate
from fedhm_flwr.config.options.factorized import FedHMOptions
from fedhm_flwr.core import protocol
from fedhm_flwr.math.train import TrainOptions
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import initial_state
from fedhm_flwr.ops.cli import main
from fedhm_flwr.server.registry import FedHMStrategy

UNKNOWN = [
    ("+method.bogus=1", "method.bogus", "'tau'"),  # a method's own section
    ("+method.bogus=1 method=heterofl", "method.bogus", "'scaler'"),
    ("+train.bogus=1", "train.bogus", "'local_epochs'"),  # a run section
    ("+failures.attack.bogus=1", "failures.attack.bogus", "'malformed'"),  # a nested one
    ("+bogus=1", "bogus", "'num_clients'"),  # the top level
]


@pytest.mark.parametrize("override, field, allowed", UNKNOWN, ids=[u[1] for u in UNKNOWN])
def test_an_unknown_key_is_refused_naming_it_and_the_allowed_keys(override, field, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(override)
    assert info.value.field == field and allowed in str(info.value)


def test_fedhm_run_refuses_an_unknown_key_before_starting_anything(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "+method.bogus=1", "--run-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "method.bogus" in err and "'svd_tolerance'" in err
    assert not out.exists()


def _saved(tmp_path, cfg, *drop: str):
    plain = OmegaConf.to_container(cfg, resolve=True)
    for dotted in drop:
        *parents, key = dotted.split(".")
        section = plain
        for p in parents:
            section = section[p]
        del section[key]
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(plain)))


def test_a_resumed_old_config_gets_today_s_defaults_of_the_keys_it_lacks(tmp_path):
    """A run saved before ``method.svd_tolerance``, ``method.official_weights``, ``levels.match`` and
    ``checkpoint.keep_best`` existed resumes with today's values of them (not a fallback of its own)."""
    cfg = load_config("rounds=3 method.tau=2")
    drop = ("method.svd_tolerance", "method.official_weights", "levels.match", "checkpoint.keep_best")
    _saved(tmp_path, cfg, *drop)
    opts = run_options(resume_config(tmp_path, "rounds=5"))
    today = run_options(load_config())
    assert opts.rounds == 5 and opts.method.tau == 2.0  # the saved values stay
    assert isinstance(opts.method, FedHMOptions)
    assert opts.method.svd_tolerance == today.method.svd_tolerance == 1e-3
    assert opts.method.official_weights is False and opts.levels.match == "none"
    assert opts.checkpoint == today.checkpoint


def test_a_resumed_config_with_an_unknown_key_is_refused(tmp_path):
    cfg = load_config("rounds=3")
    _saved(tmp_path, cfg)
    with pytest.raises(ConfigError) as info:
        resume_config(tmp_path, "train.bogus=1")  # a plain dotted override adds any key
    assert info.value.field == "train.bogus"


def test_options_are_frozen():
    opts = run_options(load_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.rounds = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.train.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.method.tau = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainOptions().lr = 1.0
    assert opts.data_spec() is not opts.data  # the data spec handed out is a copy


def test_parsing_normalises_without_rewriting_the_config():
    """``method.tau=.inf`` is infinity in the options; the check leaves the config as composed."""
    cfg = compose_config("method.tau=.inf")
    before = OmegaConf.to_yaml(cfg)
    validate(cfg)
    assert OmegaConf.to_yaml(cfg) == before
    assert run_options(cfg).method.tau == math.inf
    assert run_options(load_config("levels.ratios=[1,0.5]")).levels.ratios == (1.0, 0.5)  # floats, a tuple


def test_a_user_model_is_put_in_place_where_the_config_is_composed_and_the_check_changes_nothing():
    """``model.target`` makes ``model.arch`` custom and ``model.width`` null once, when the config is
    composed; a config holding a target but not yet normalised (as Hydra composes a sweep's job) is
    checked as if it were (the same error) and left as it is."""
    target = "model.target=torchvision.models:nope"
    composed = compose_config("model.target=tests.tv_models:grey model.kwargs.name=mobilenet_v3_small")
    assert composed.model.arch == "custom" and composed.model.width is None
    raw = OmegaConf.merge(compose_config(), {"model": {"target": "torchvision.models:nope"}})
    assert raw.model.arch == "cnn" and raw.model.width is not None  # not normalised
    before = OmegaConf.to_yaml(raw)
    with pytest.raises(ConfigError) as checked:
        validate(raw)
    assert OmegaConf.to_yaml(raw) == before
    with pytest.raises(ConfigError) as loaded:
        load_config(target)
    assert checked.value.field == loaded.value.field == "model.target" and str(checked.value) == str(loaded.value)


def test_train_options_refuse_an_unknown_key_naming_it():
    assert TrainOptions.from_dict({"lr": 0.1, "batch_size": 4}) == TrainOptions(lr=0.1, batch_size=4)
    with pytest.raises(ValueError, match=r"unknown train option 'bogus'; allowed: \['lr', 'local_epochs'"):
        TrainOptions.from_dict({"lr": 0.1, "bogus": 1})


def test_a_client_given_an_unknown_train_option_replies_an_error_and_the_round_goes_on(toy_cfg):
    cfg = toy_cfg("fraction_train=1.0")
    spec = model_spec(cfg)
    handlers = client_handlers()
    real = handlers[MessageType.TRAIN]

    def tampered(msg, ctx):  # partition 0 is sent a train option no client knows
        if int(ctx.node_config["partition-id"]) == 0:
            config = msg.content[protocol.CONFIG]
            config[protocol.TRAIN] = json.dumps({**json.loads(str(config[protocol.TRAIN])), "bogus": 1})
        return real(msg, ctx)

    handlers[MessageType.TRAIN] = tampered
    strategy, grid = FedHMStrategy(run_options(cfg), spec), LocalGrid(6, handlers)
    msgs = list(
        strategy.configure_train(1, ArrayRecord.from_torch_state_dict(initial_state(cfg.seed, spec)), None, grid)
    )
    replies = list(grid.send_and_receive(msgs))
    refused = [r for r in replies if r.has_error()]
    assert len(refused) == 1 and "unknown train option 'bogus'" in refused[0].error.reason
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["replies"] == 5  # the other five merged
    row = strategy._round_row(1, metrics)
    assert row["failures"] == 1 and "unknown train option 'bogus'" in row["failure_reasons"]
