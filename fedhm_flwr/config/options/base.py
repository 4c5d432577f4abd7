"""The base of every method's options (:class:`MethodOptions`), the option types several methods
share (``method.tau``, ``method.rho``, ``method.grad_clip``, ...: declared once here, their default
per method), and the table of every method's options.

:data:`OPTIONS` fills itself: a subclass of :class:`MethodOptions` that sets its own ``name`` is
that method's options and is added under that name when its class statement runs (a base of a
family, without a name of its own, is not). It lives here so that a method's check can list the
supported pairs (:func:`supported_pairs`) without importing the package that imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar, cast

from omegaconf import DictConfig, OmegaConf
from pydantic import AfterValidator, Strict, ValidationInfo, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Self

from fedhm_flwr.config.options.declare import DECLARED, InfNum, option, parse
from fedhm_flwr.config.options.sections import ROBUST
from fedhm_flwr.core.errors import ConfigError

#: the built-in conv nets, built by width
CONV_ARCHS = ("cnn", "resnet18", "resnet34")
#: the start of what a width-slicing method needs from a model
BY_WIDTH = (
    "a model built by width (a constructor slicing channels by width_rate, as the built-in "
    "cnn/resnet18/resnet34), since "
)


def _at_least_zero(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise ValueError("negative")
    return value


# the option types several methods declare (each with its own default): type, range, allowed text
TAU = "a number > 0 (inf or .inf for uniform weights)"
#: ``method.tau``: softmax(gamma / tau) aggregation weights; YAML's ``.inf`` means infinity
Tau = InfNum
#: ``method.rho``: leading factorizable layers kept full rank (null: the model's default)
Rho = Annotated[Annotated[int, Strict()] | None, AfterValidator(_at_least_zero)]
RHO = "null (the model's default) or an integer >= 0"


def tau(default: float) -> Any:
    return option(default, "softmax(gamma / tau) aggregation weights; inf = uniform", allowed=TAU, gt=0.0, le=math.inf)


def rho(default: int | None, allowed: str = RHO) -> Any:
    return option(default, "leading factorizable layers kept full rank (null: the model's default)", allowed=allowed)


def grad_clip(default: float) -> Any:
    """``method.grad_clip`` >= 0 (0: off): its clients clip at it in place of ``train.grad_clip``
    (see :meth:`MethodOptions.clips`)."""
    return option(default, "clients clip the gradient norm at this value (0 = off)", ge=0.0, lt=math.inf)


def weight_by_samples(default: bool) -> Any:
    return option(default, "weight each reply by its client's sample count")


def frobenius_decay(default: bool) -> Any:
    return option(default, "lambda/2 ||AB||_F^2 on factorized pairs instead of weight decay")


#: ``method.name`` -> its options class, filled by the classes themselves (see
#: :meth:`MethodOptions.__init_subclass__`), in the order their modules are imported
#: (:mod:`fedhm_flwr.config.options`): the order of the method list and of the supported pairs in
#: messages. The method declares the same class as ``Method.options``.
OPTIONS: dict[str, type[MethodOptions]] = {}


@dataclass(frozen=True, config=DECLARED)
class MethodOptions:
    """What a method accepts of a config: its ``method`` group (:meth:`check`) and the models it
    runs on (:attr:`models`; :attr:`needs` says what a refused model lacks). One subclass per
    method, registered in :data:`OPTIONS` and declared by the method as ``Method.options``; an
    instance is the method's parsed, typed ``method`` group (:meth:`parse`), its fields the
    declarations of the keys of ``conf/method/<name>.yaml`` (which holds the same defaults)."""

    #: ``method.name``
    name: ClassVar[str] = ""
    #: the ``model.arch`` values the method runs on (``custom``: a ``model.target``)
    models: ClassVar[tuple[str, ...]] = ()
    #: what the method needs from a model (said when it refuses one)
    needs: ClassVar[str] = ""
    #: ``conf/method/<preset>.yaml`` files of this method other than ``<name>.yaml``, with the
    #: values in which they differ from the declared defaults
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

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
        """Refuse the first invalid value of the ``method`` group with a :class:`ConfigError` (the
        rules across sections read the rest of ``cfg``)."""
        plain = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(plain, dict)
        cls.parse(plain["method"], cast("dict[str, Any]", plain))

    @classmethod
    def parse(cls, section: Any, config: Mapping[str, Any] | None = None) -> Self:
        """The typed ``method`` group (``name`` is the class's own; every other key must be a field);
        with the whole ``config``, its rules across sections are checked too."""
        values = dict(section)
        name = values.pop("name", cls.name)
        if name != cls.name:
            raise ConfigError("method.name", name, f"{cls.name!r} for {cls.__name__}")
        return parse(cls, values, "method", context=config)

    @model_validator(mode="after")
    def _across(self, info: ValidationInfo) -> Self:
        """The method's rules across sections, where a config is parsed (its plain values: the
        context): :meth:`across`, and a ``train.grad_clip`` that :meth:`clips` would ignore."""
        if info.context:
            self.across(info.context)
            self._grad_clip_precedence(info.context)
        return self

    def across(self, config: Mapping[str, Any]) -> None:
        """Refuse a value of another section that this method's options rule out (none here)."""

    def clips(self) -> float | None:
        """The gradient norm this method's clients clip at in place of ``train.grad_clip`` (None:
        they clip at ``train.grad_clip``)."""
        return None

    def _grad_clip_precedence(self, config: Mapping[str, Any]) -> None:
        """The method's ``grad_clip`` takes precedence over ``train.grad_clip``: a ``train.grad_clip``
        > 0 that differs from it (it would be ignored) is refused, naming both keys."""
        method_clip = self.clips()
        train_clip = (config.get("train") or {}).get("grad_clip", 0.0)
        if method_clip is None or not isinstance(train_clip, (int, float)) or isinstance(train_clip, bool):
            return
        if train_clip > 0 and train_clip != method_clip:
            raise ConfigError(
                "train.grad_clip",
                train_clip,
                f"0 or {method_clip}: method={self.name} clips at method.grad_clip={method_clip}, which takes "
                f"precedence over train.grad_clip (set method.grad_clip={train_clip} instead)",
            )

    def robust_modes(self) -> tuple[str, ...]:
        """The ``aggregation.robust`` values the method's merge allows. Clipping, median and trimmed
        mean need a merge that is an element-wise (weighted) mean over the clients covering an
        element; Krum (and DP) need replies that all cover the whole model."""
        return ("none",)  # the norm filter (aggregation.outlier_z) only

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


#: the robust aggregations of an element-wise merge over the clients covering an element (no Krum)
ELEMENTWISE_MODES = tuple(m for m in ROBUST if m != "krum")
