"""Each method declares its config validation (``Method.options``), and it is the one the config
check runs: the torch-free ``MethodOptions`` class of ``fedhm_flwr.config.options``."""

import pytest

from fedhm_flwr.config import OPTIONS, ConfigError, compose_config, load_config
from fedhm_flwr.server.methods.fedavg import FedAvgFedHM, FedAvgHeteroFL
from fedhm_flwr.server.registry import METHODS


def test_every_method_declares_the_options_the_config_check_uses():
    assert set(METHODS) == set(OPTIONS)
    for name, method in METHODS.items():
        assert method.name == name and OPTIONS[name].name == name
        assert method.options is OPTIONS[name], name
    # FedAvg's builder and the two classes it builds declare the same options
    assert FedAvgFedHM.options is FedAvgHeteroFL.options is OPTIONS["fedavg"]


# one field per method that no other test refuses, checked through load_config (what users meet)
# and through the options class the method declares (Method.options)
BAD = [
    ("fedhm", "method=fedhm method.official_weights=maybe", "method.official_weights"),
    ("heterofl", "method=heterofl method.weight_by_samples=maybe", "method.weight_by_samples"),
    ("fedrolex", "method=fedrolex method.grad_clip=-1", "method.grad_clip"),
    ("fedavg", "method=fedavg method.frobenius_decay=maybe", "method.frobenius_decay"),
    ("prism", "method=prism method.rho=-1", "method.rho"),
    ("fedlora", "method=fedlora method.mode=rank", "method.mode"),
    ("heterotune", "method=heterotune method.optimizer=adam", "method.optimizer"),  # the transformer base's field
]


@pytest.mark.parametrize("name, override, field", BAD, ids=[b[0] for b in BAD])
def test_a_bad_method_field_is_refused_naming_it(name, override, field):
    with pytest.raises(ConfigError) as by_load:
        load_config(override)
    assert by_load.value.field == field and field in str(by_load.value)
    with pytest.raises(ConfigError) as by_method:
        METHODS[name].options.check(compose_config(override))
    assert str(by_method.value) == str(by_load.value)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_built_from_another_methods_options_is_refused_naming_both(name):
    """A method reads its options as its own class (``method_options``), a TypeError otherwise: a
    HeteroFL run's options handed to another method do not pass silently (under ``python -O`` too)."""
    from fedhm_flwr.config.options import run_options
    from fedhm_flwr.server.methods.method import method_options

    other = "heterofl" if name != "heterofl" else "fedhm"
    opts = run_options(load_config(f"method={other}"))
    if isinstance(opts.method, METHODS[name].options):
        pytest.skip(f"{other}'s options are also {name}'s")
    with pytest.raises(TypeError, match=f"{METHODS[name].options.__name__} expected, got {type(opts.method).__name__}"):
        method_options(opts, METHODS[name].options)
    assert method_options(run_options(load_config(f"method={name}")), METHODS[name].options) is not None
