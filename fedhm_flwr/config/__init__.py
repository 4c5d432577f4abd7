"""Compose the Hydra tree in ``conf/``, apply overrides and validate with clear errors.

Every entry point (the ServerApp, ``launch``, ``sweep``, ``inspect``) goes through
:func:`load_config`, so a bad value is refused the same way everywhere: one
:class:`~fedhm_flwr.core.errors.ConfigError` naming the field and the allowed values, before any
expensive work (Ray, data loading, training) starts. No Flower import here, and no torch import
on the way to a valid config of a built-in model (the launcher checks a config first).

The pieces: :mod:`fedhm_flwr.config.options` (every option declared once: the shared sections,
the model and dataset groups, per-method validation, one ``MethodOptions`` class per method
that the method declares as ``Method.options``, and the supported (method, model) pairs),
:mod:`fedhm_flwr.config.methods` (the pair and user-model checks),
:mod:`fedhm_flwr.config.specs` (model and data specs derived from a config). Their public names
are importable from here too.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedhm_flwr.config.methods import (
    robust_modes,
    validate_pair,
    validate_user_model,
    with_user_model,
)
from fedhm_flwr.config.options import (
    OPTIONS,
    SUPPORTED_MODELS,
    MethodOptions,
    RunOptions,
    method_key,
    run_options,
    supported_pairs,
)
from fedhm_flwr.config.options.groups import ARCH_NAMES, parse_dataset
from fedhm_flwr.config.options.sections import (
    ASSIGNMENTS,
    ATTACKS,
    BN_STATS,
    EVALUATION_WHERE,
    LEVEL_MATCH,
    LR_SCHEDULES,
    PARTITION_SCHEMES,
    RAY_ADDRESS,
    ROBUST,
)
from fedhm_flwr.config.specs import (
    backbone_choice,
    data_spec,
    holdout_fraction,
    learning_rate,
    level_proportions,
    lr_schedule,
    model_spec,
    source_options,
)
from fedhm_flwr.core.errors import ConfigError

__all__ = [  # the re-exported names of the submodules and this module's own
    "ARCH_NAMES",
    "ASSIGNMENTS",
    "ATTACKS",
    "BN_STATS",
    "CONF_DIR",
    "EVALUATION_WHERE",
    "LEVEL_MATCH",
    "LR_SCHEDULES",
    "OPTIONS",
    "PARTITION_SCHEMES",
    "RAY_ADDRESS",
    "ROBUST",
    "SUPPORTED_MODELS",
    "ConfigError",
    "MethodOptions",
    "RunOptions",
    "backbone_choice",
    "base_defaults",
    "compose_config",
    "data_spec",
    "holdout_fraction",
    "learning_rate",
    "level_proportions",
    "load_config",
    "lr_schedule",
    "method_defaults",
    "method_key",
    "model_spec",
    "resume_config",
    "robust_modes",
    "run_options",
    "source_options",
    "split_overrides",
    "supported_pairs",
    "to_yaml",
    "validate",
    "validate_pair",
    "validate_user_model",
    "with_user_model",
]

CONF_DIR = Path(os.environ.get("FEDHM_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))


def split_overrides(overrides: str | Sequence[str] | None) -> list[str]:
    """Accept overrides as one shell-like string (run-config) or as a list (command line)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return shlex.split(overrides)
    return [o for item in overrides for o in shlex.split(item)]


def _open_kwargs(item: str) -> str:
    """``model.kwargs.<key>=v`` adds the key without Hydra's ``+``: the factory's keyword arguments
    are the user's, not keys of ``conf/``."""
    return f"++{item}" if item.startswith("model.kwargs.") else item


def compose_config(overrides: str | Sequence[str] | None = None) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides (no validation; a ``model.target`` put in
    place of the group's model, :func:`~fedhm_flwr.config.methods.with_user_model`)."""
    override_list = [_open_kwargs(o) for o in split_overrides(overrides)]
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"Hydra config tree not found at {CONF_DIR} (set FEDHM_CONF_DIR)")
    try:
        if GlobalHydra.instance().is_initialized():  # inside a Hydra app (the sweep): same tree
            cfg = compose(config_name="config", overrides=override_list)
        else:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=override_list)
    except (HydraException, OmegaConfBaseException) as err:
        raise _override_error(err, override_list) from None
    return with_user_model(cfg)


def _override_error(err: Exception, overrides: list[str]) -> ConfigError:
    """Turn Hydra's override errors into a ConfigError naming the offending key."""
    text = str(err).splitlines()[0]
    for item in sorted(overrides, key=lambda o: -len(o.split("=", 1)[0])):  # dataset.channels before dataset
        key = item.lstrip("+~").split("=", 1)[0]
        if key and key in str(err):
            group = key.split(".")[0]
            options = _group_options(group)
            allowed = f"one of {options}" if options else "an existing key of conf/config.yaml"
            if "." in key and options:  # a key of a group's choice (dataset.channels), not the choice
                allowed = _group_key_allowed(key, overrides)
            return ConfigError(key, item.split("=", 1)[-1], f"{allowed} ({text})")
    return ConfigError("overrides", " ".join(overrides), f"valid Hydra overrides ({text})")


def _group_key_allowed(key: str, overrides: list[str]) -> str:
    """What is allowed in place of ``group.name`` that the chosen option of ``group`` lacks: that
    option's keys, and which options of the group take ``name``."""
    group, name = key.split(".")[0], key.split(".")[1]
    chosen = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == group), None)
    if chosen is None:
        defaults = cast(DictConfig, OmegaConf.load(CONF_DIR / "config.yaml")).get("defaults", [])  # a mapping
        chosen = next((str(d[group]) for d in defaults if isinstance(d, DictConfig) and group in d), None)
    keys = {o: set(OmegaConf.load(CONF_DIR / group / f"{o}.yaml")) for o in _group_options(group)}
    if chosen not in keys:
        return f"a key of the {group} group's options {sorted(keys)}"
    takers = sorted(o for o, has in keys.items() if name in has)
    return f"a key of {group}={chosen}: {', '.join(sorted(keys[chosen]))}" + (
        f" ({name} is a key of {group}={'|'.join(takers)} only)" if takers else ""
    )


def _group_options(group: str) -> list[str]:
    folder = CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_config(overrides: str | Sequence[str] | None = None) -> DictConfig:
    """Compose and validate: the one way every entry point obtains its configuration."""
    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def base_defaults() -> DictConfig:
    """``conf/config.yaml``'s own keys (not its groups', nor Hydra's settings): a saved config gets
    today's defaults for the keys it lacks (added since it was saved)."""
    plain = OmegaConf.load(CONF_DIR / "config.yaml")
    assert isinstance(plain, DictConfig)
    for key in ("defaults", "hydra"):
        plain.pop(key, None)
    return plain


def method_defaults(name: str) -> DictConfig:
    """Today's ``method`` group of the method ``name`` (``conf/method/<name>.yaml``; a group that
    places itself at the top level keeps it under ``method``)."""
    path = CONF_DIR / "method" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("method.name", name, f"one of {_group_options('method')}")
    group = OmegaConf.load(path)
    assert isinstance(group, DictConfig)
    group.pop("defaults", None)
    method = group.get("method", group)
    assert isinstance(method, DictConfig)
    return method


def resume_config(run_dir: str | Path, overrides: str | Sequence[str] | None = None) -> DictConfig:
    """The configuration saved in ``run_dir`` (a run being resumed), with plain ``key=value``
    overrides on top (e.g. ``rounds=20`` to extend it), validated."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError("resume", str(run_dir), "a run directory holding config.yaml and checkpoint/")
    saved_cfg = OmegaConf.load(saved)
    name = OmegaConf.select(saved_cfg, "method.name")
    today = OmegaConf.merge(base_defaults(), {"method": method_defaults(str(name))})
    cfg = OmegaConf.merge(today, saved_cfg)  # keys added since the run was saved get today's defaults
    items = split_overrides(overrides)
    if items:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(items))
        except OmegaConfBaseException as err:
            raise ConfigError("overrides", " ".join(items), f"key=value pairs of existing keys ({err})") from None
    assert isinstance(cfg, DictConfig)
    cfg = with_user_model(cfg)  # an override may name a model.target
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Refuse the first invalid value, or a key no section knows, with a :class:`ConfigError` naming
    the field (:func:`run_options` parses what is checked here; the server builds its options with it).
    Changes nothing in ``cfg``: a config whose ``model.target`` is not yet in place (one Hydra composed
    for a sweep's job) is checked as :func:`with_user_model` puts it."""
    cfg = with_user_model(cfg)
    name = OmegaConf.select(cfg, "method.name")
    if name not in OPTIONS:  # the method's name picks its declaration
        raise ConfigError("method.name", name, f"one of {list(OPTIONS)}")
    validate_user_model(cfg)  # the model group
    OPTIONS[name].check(cfg)
    validate_pair(cfg)
    parse_dataset(cast("dict[str, Any]", OmegaConf.to_container(cfg.dataset, resolve=True)))  # a mapping: composed
    run_options(cfg)  # every section parsed against its declaration, a key no section knows refused


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
