"""The base of every method's options (:class:`MethodOptions`), the checks several methods share
(``method.tau``, ``method.rho``, ``method.grad_clip``), the table of every method's options, and
:func:`parse_options`: a section of the config as a frozen dataclass, unknown keys refused.

:data:`OPTIONS` fills itself: a subclass of :class:`MethodOptions` that sets its own ``name`` is
that method's options and is added under that name when its class statement runs (a base of a
family, without a name of its own, is not). It lives here so that a method's check can list the
supported pairs (:func:`supported_pairs`) without importing the package that imports it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, cast

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import is_int, is_num, num_in, require
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


def check_grad_clip(cfg: DictConfig, used: bool = True) -> None:
    """``method.grad_clip`` >= 0 (0: off). Where the method clips with it (``used``), its clients clip
    at ``method.grad_clip`` in place of ``train.grad_clip``: the method's key takes precedence, so a
    ``train.grad_clip`` > 0 that differs from it (it would be ignored) is refused, naming both keys."""
    num_in(cfg, "method.grad_clip", 0.0, math.inf, high_open=True)
    method_clip = OmegaConf.select(cfg, "method.grad_clip")
    train_clip = OmegaConf.select(cfg, "train.grad_clip", default=0.0)
    if used and is_num(train_clip) and train_clip > 0 and train_clip != method_clip:
        raise ConfigError(
            "train.grad_clip",
            train_clip,
            f"0 or {method_clip}: method={cfg.method.name} clips at method.grad_clip={method_clip}, which takes "
            f"precedence over train.grad_clip (set method.grad_clip={train_clip} instead)",
        )


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
    return [f.name for f in dataclasses.fields(cls)]


def _convert(hint: Any, value: Any, field: str) -> Any:
    """``value`` as the type ``hint`` says (see :func:`parse_options`)."""
    if dataclasses.is_dataclass(hint):
        kind = cast("type[Any]", hint)  # a field's type hint: a dataclass type, never an instance
        return value if isinstance(value, kind) else parse_options(kind, value, field)
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


#: ``method.name`` -> its options class, filled by the classes themselves (see
#: :meth:`MethodOptions.__init_subclass__`), in the order their modules are imported
#: (:mod:`fedhm_flwr.config.options`): the order of the method list and of the supported pairs in
#: messages. The method declares the same class as ``Method.options``.
OPTIONS: dict[str, type[MethodOptions]] = {}


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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass naming a method (its own ``name``) is that method's options: it joins
        :data:`OPTIONS`; a second class of the same name is refused."""
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            if name in OPTIONS:
                raise TypeError(f"method.name {name!r}: {cls.__name__} and {OPTIONS[name].__name__} both declare it")
            OPTIONS[name] = cls

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


def supported_pairs() -> str:
    """The supported (method, model) pairs of :data:`OPTIONS`, as error messages list them."""
    return "; ".join(f"{m}: {list(a)}" for o in OPTIONS.values() for m, (a, _) in o.pairs().items())
