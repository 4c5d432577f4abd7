"""What the config check still reads by path: the ``model`` and ``dataset`` groups' keys (width,
dataset name, a folder source's options, the example limits) and the rules :func:`require` and
:func:`choice` that :mod:`fedhm_flwr.config.methods` uses for a user's model. Every other option is
declared once in :mod:`fedhm_flwr.config.options` and checked there.

Torch-free (the launcher checks a config before importing torch): this module imports the data
catalog and specs only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.data.catalog import DATASETS, EXTERNAL_DATASETS, FOLDER_SOURCES
from fedhm_flwr.data.spec import SOURCE_DEFAULTS, source_field_problem

# --------------------------------------------------------------------------- field rules


def require(ok: object, field: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` (``field``, ``value``, what is ``allowed``) unless ``ok`` (is true)."""
    if not ok:
        raise ConfigError(field, value, allowed)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def choice(cfg: DictConfig, field: str, allowed: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, field)
    allowed = tuple(allowed)
    require(value in allowed, field, value, f"one of {list(allowed)}")


def int_at_least(cfg: DictConfig, field: str, low: int) -> None:
    value = OmegaConf.select(cfg, field)
    require(is_int(value) and value >= low, field, value, f"an integer >= {low}")


def _validate_source(cfg: DictConfig) -> None:
    """A folder source's options (``dataset.path``, ``dataset.image_size``, ...): the data spec's rules."""
    if cfg.dataset.name not in SOURCE_DEFAULTS:
        return
    for key, default in SOURCE_DEFAULTS[cfg.dataset.name].items():
        value = cfg.dataset.get(key, default)
        problem = source_field_problem(key, value)
        require(problem is None, f"dataset.{key}", value, str(problem))
    data_dir = cfg.dataset.get("data_dir")
    require(data_dir is None, "dataset.data_dir", data_dir, "null: dataset.path says where the data is")


def validate_groups(cfg: DictConfig) -> None:
    """What every method reads of the ``model`` and ``dataset`` groups (the first invalid value raises)."""
    width = OmegaConf.select(cfg, "model.width")
    require(
        width is None or (is_int(width) and width >= 1),
        "model.width",
        width,
        "null (the architecture's default) or an integer >= 1",
    )
    choice(cfg, "dataset.name", [*DATASETS, *EXTERNAL_DATASETS, *FOLDER_SOURCES])
    _validate_source(cfg)
    for field in ("dataset.max_train_examples", "dataset.max_test_examples"):
        int_at_least(cfg, field, 0)
