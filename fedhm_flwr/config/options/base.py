"""The base of every method's options (:class:`MethodOptions`), the checks several methods share
(``method.tau``, ``method.rho``), the registry the supported pairs are read from, and
:func:`parse_options`: a section of the config as a frozen dataclass, unknown keys refused.

:data:`OPTIONS` is filled, in the order of the supported pairs in error messages, by
:mod:`fedhm_flwr.config.options`; it lives here so that a method's check can list the supported
pairs (:func:`supported_pairs`) without importing the package that imports it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import is_int, is_num, require
from fedhm_flwr.core.errors import ConfigError

T = TypeVar("T")

#: the built-in conv nets, built by width
CONV_ARCHS = ("cnn", "resnet18", "resnet34")
#: the start of what a width-slicing method needs from a model
BY_WIDTH = (
    "a model built by width (a constructor slicing channels by width_rate, as the built-in "
    "cnn/resnet18/resnet34), since "
)


def yaml_number(value: Any) -> Any:
    """YAML's ``.inf`` (a string to Hydra's override grammar) as infinity; any other value as it is."""
    if isinstance(value, str) and value.strip().lower() in (".inf", "+.inf"):
        return math.inf
    return value


def check_tau(cfg: DictConfig) -> None:
    """``method.tau`` > 0; YAML's ``.inf`` means infinity (the parsed options hold ``math.inf``)."""
    tau = yaml_number(OmegaConf.select(cfg, "method.tau"))
    require(is_num(tau) and tau > 0, "method.tau", tau, "a number > 0 (inf or .inf for uniform weights)")


def check_rho(cfg: DictConfig, default: str = "null (the model's default) or an integer >= 0") -> None:
    rho = OmegaConf.select(cfg, "method.rho")
    require(rho is None or (is_int(rho) and rho >= 0), "method.rho", rho, default)


def parse_options(cls: type[T], values: Any, section: str) -> T:
    """The frozen dataclass ``cls`` of the config section ``values`` (a mapping; ``section``: its
    dotted name, "" for the config's top level). A key that is not a field of ``cls`` is refused
    with a :class:`ConfigError` naming it and the allowed keys; a missing key takes the field's
    default (none: refused too). Values are converted to the fields' types: a nested dataclass is
    parsed the same way, a list becomes a tuple, an integer a float where the field is a float
    (YAML's ``.inf`` too)."""
    if not isinstance(values, Mapping):
        raise ConfigError(section, values, f"a mapping of the keys {_field_names(cls)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    where = f"{section}." if section else ""
    for key in values:
        if key not in known:
            raise ConfigError(
                f"{where}{key}", values[key], f"a key of {section or 'the config'}: one of {_field_names(cls)}"
            )
    out = {}
    for name, f in known.items():
        if name in values:
            out[name] = _convert(hints[name], values[name], f"{where}{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}{name}", None, f"a value: every key of {_field_names(cls)} is needed")
    return cls(**out)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


def _convert(hint: Any, value: Any, field: str) -> Any:
    """``value`` as the type ``hint`` says (see :func:`parse_options`)."""
    if dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else parse_options(hint, value, field)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, field)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(_convert(args[0], v, field) for v in value)
    if hint is float:
        value = yaml_number(value)
        return float(value) if is_int(value) else value
    return value


@dataclasses.dataclass(frozen=True)
class MethodOptions:
    """What a method accepts of a config: its ``method`` group (:meth:`check`) and the models it
    runs on (:attr:`models`; :attr:`needs` says what a refused model lacks). One subclass per
    method, registered in :data:`OPTIONS` and declared by the method as ``Method.options``; an
    instance is the method's parsed, typed ``method`` group (:meth:`parse`), its fields the keys of
    ``conf/method/<name>.yaml`` (where their defaults are)."""

    #: ``method.name``
    name: ClassVar[str] = ""
    #: the ``model.arch`` values the method runs on (``custom``: a ``model.target``)
    models: ClassVar[tuple[str, ...]] = ()
    #: what the method needs from a model (said when it refuses one)
    needs: ClassVar[str] = ""

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        """Refuse the first invalid value of the ``method`` group with a :class:`ConfigError`."""

    @classmethod
    def parse(cls: type[M], section: Any) -> M:
        """The typed ``method`` group (``name`` is the class's own; every other key must be a field)."""
        values = dict(section)
        name = values.pop("name", cls.name)
        require(name == cls.name, "method.name", name, f"{cls.name!r} for {cls.__name__}")
        return parse_options(cls, values, "method")

    @classmethod
    def pairs(cls) -> dict[str, tuple[tuple[str, ...], str]]:
        """Pair key (``method.name``, or ``fedavg/heterofl``) -> (models, needs)."""
        return {cls.name: (cls.models, cls.needs)}

    @classmethod
    def pair_key(cls, cfg: DictConfig) -> str:
        """The key of :meth:`pairs` that ``cfg`` runs under."""
        return cls.name


M = TypeVar("M", bound=MethodOptions)

#: ``method.name`` -> its options (every method adds itself in :mod:`fedhm_flwr.config.options` and
#: declares them as ``Method.options``); this order is the order of the supported pairs in error messages.
OPTIONS: dict[str, type[MethodOptions]] = {}


def supported_pairs() -> str:
    """The supported (method, model) pairs of :data:`OPTIONS`, as error messages list them."""
    return "; ".join(f"{m}: {list(a)}" for o in OPTIONS.values() for m, (a, _) in o.pairs().items())
