"""The Hydra tree composes, and every kind of bad value is refused naming the field."""

import math

import pytest

from fedhm_flwr.config import ConfigError, data_spec, learning_rate, load_config, model_spec


def test_default_config_is_the_papers_setting():
    cfg = load_config()
    assert cfg.method.name == "fedhm" and cfg.dataset.name == "fashion_mnist" and cfg.model.arch == "cnn"
    assert list(cfg.levels.ratios) == [1.0, 0.5, 0.25, 0.125]
    assert cfg.num_clients >= 10
    assert model_spec(cfg)["num_classes"] == 10 and model_spec(cfg)["in_channels"] == 1


def test_overrides_string_and_list_agree():
    a = load_config("levels.ratios=[1,0.25] levels.proportions=[3,1] method.tau=2 partition.alpha=0.1")
    b = load_config(["levels.ratios=[1,0.25]", "levels.proportions=[3,1]", "method.tau=2", "partition.alpha=0.1"])
    assert a == b and list(a.levels.ratios) == [1, 0.25] and a.method.tau == 2


def test_null_proportions_mean_equal_shares_for_any_level_set():
    from fedhm_flwr.config import level_proportions

    assert level_proportions(load_config("levels.ratios=[1,0.25]")) == [1.0, 1.0]
    assert level_proportions(load_config("levels.ratios=[1,0.25] levels.proportions=[1,3]")) == [1.0, 3.0]


def test_uniform_weights_parse_as_infinity():
    assert math.isinf(load_config("method.tau=inf").method.tau)


@pytest.mark.parametrize(
    "override, field",
    [
        ("method.tau=0", "method.tau"),
        ("method.rho=-1", "method.rho"),
        ("method.svd_tolerance=0", "method.svd_tolerance"),
        ("method.svd_tolerance=1", "method.svd_tolerance"),
        ("levels.ratios=[0.5,1]", "levels.ratios"),
        ("levels.ratios=[1,1.5]", "levels.ratios"),
        ("levels.ratios=[]", "levels.ratios"),
        ("levels.proportions=[1,1]", "levels.proportions"),
        ("levels.proportions=[1,-1,1,1]", "levels.proportions"),
        ("levels.assignment=random", "levels.assignment"),
        ("levels.default=0.3", "levels.default"),
        ("partition.scheme=shards", "partition.scheme"),
        ("partition.alpha=0", "partition.alpha"),
        ("rounds=0", "rounds"),
        ("fraction_train=1.5", "fraction_train"),
        ("train.lr=-0.1", "train.lr"),
        ("train.lr_schedule=warmup", "train.lr_schedule"),
        ("train.batch_size=2.5", "train.batch_size"),
        ("train.momentum=1", "train.momentum"),
        ("evaluation.bn_stats=running", "evaluation.bn_stats"),
        ("simulation.num_gpus=-1", "simulation.num_gpus"),
        ("output_dir=relative/path", "output_dir"),
        ("model=resnet19", "model"),
        ("dataset=mnist3d", "dataset"),
        ("no_such_key=1", "no_such_key"),
        ("stragglers.quorum=0", "stragglers.quorum"),
        ("evaluation.bn_examples=-1", "evaluation.bn_examples"),
        ("stragglers.factor=0.5", "stragglers.factor"),
        ("stragglers.min_seconds=-1", "stragglers.min_seconds"),
        ("aggregation.max_examples=0", "aggregation.max_examples"),
        ("aggregation.krum_fraction=0.5", "aggregation.krum_fraction"),
        ("failures.attack.malformed=gibberish", "failures.attack.malformed"),
    ],
)
def test_malformed_config_is_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(override)
    assert info.value.field == field
    assert field in str(info.value) and "allowed" in str(info.value)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        load_config("method.name=fedmagic")
    assert info.value.field == "method.name" and "fedhm" in info.value.allowed


def test_learning_rate_schedules():
    cfg = load_config("rounds=10 train.lr=0.1")
    assert learning_rate(cfg, 1) == learning_rate(cfg, 10) == 0.1
    cos = load_config("rounds=10 train.lr=0.1 train.lr_schedule=cosine")
    assert learning_rate(cos, 1) == pytest.approx(0.1) and learning_rate(cos, 10) < learning_rate(cos, 5) < 0.1
    step = load_config("rounds=10 train.lr=0.1 train.lr_schedule=step train.lr_step_rounds=[0.5] train.lr_gamma=0.1")
    assert learning_rate(step, 5) == pytest.approx(0.1) and learning_rate(step, 6) == pytest.approx(0.01)


def test_data_spec_carries_partitioning_not_locations():
    spec = data_spec(load_config("partition.scheme=iid seed=3"), num_partitions=7)
    assert spec["scheme"] == "iid" and spec["seed"] == 3 and spec["num_partitions"] == 7
    assert not any("dir" in k for k in spec)  # the node knows where its data is


def test_a_resumed_config_gets_the_keys_added_since_it_was_saved(tmp_path):
    """A run saved before ``stragglers`` and ``aggregation.max_examples`` existed resumes with today's
    defaults for them (and keeps every value it saved)."""
    from omegaconf import OmegaConf

    from fedhm_flwr.config import resume_config

    saved = OmegaConf.to_container(load_config("rounds=3 aggregation.robust=clip"), resolve=True)
    del saved["stragglers"], saved["aggregation"]["max_examples"]
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    cfg = resume_config(tmp_path, "rounds=5")
    assert cfg.rounds == 5 and cfg.aggregation.robust == "clip" and cfg.aggregation.max_examples is None
    assert cfg.stragglers == load_config().stragglers


def test_more_clients_than_training_examples_are_refused_naming_num_clients():
    with pytest.raises(
        ConfigError,
        match=r"num_clients=100000; allowed: an integer <= 3,000: "
        r"dataset\.max_train_examples=6000 training examples and "
        r"partition\.scheme=dirichlet gives every client at least 2",
    ) as info:
        load_config("num_clients=100000 dataset.max_train_examples=6000")
    assert info.value.field == "num_clients"
    with pytest.raises(
        ConfigError,
        match=r"num_clients=6001; allowed: an integer <= 6,000: .*every client needs at "
        r"least one \(lower num_clients or raise dataset\.max_train_examples\)",
    ):
        load_config("num_clients=6001 dataset.max_train_examples=6000 partition.scheme=iid")
    with pytest.raises(
        ConfigError,
        match=r"<= 50,000: dataset\.name=cifar10 has 50,000 training examples.*"
        r"\(lower num_clients\)",
    ):
        load_config("num_clients=50001 dataset=cifar10 partition.scheme=pathological")
    assert load_config("num_clients=6000 dataset.max_train_examples=6000 partition.scheme=iid").num_clients == 6000
    assert load_config("num_clients=3000 dataset.max_train_examples=6000").num_clients == 3000
