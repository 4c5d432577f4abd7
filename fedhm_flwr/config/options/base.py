"""The base of every method's options (:class:`MethodOptions`), the checks several methods share
(``method.tau``, ``method.rho``) and the registry the supported pairs are read from.

:data:`OPTIONS` is filled, in the order of the supported pairs in error messages, by
:mod:`fedhm_flwr.config.options`; it lives here so that a method's check can list the supported
pairs (:func:`supported_pairs`) without importing the package that imports it.
"""

from __future__ import annotations

import math
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import is_int, is_num, require

#: the built-in conv nets, built by width
CONV_ARCHS = ("cnn", "resnet18", "resnet34")
#: the start of what a width-slicing method needs from a model
BY_WIDTH = (
    "a model built by width (a constructor slicing channels by width_rate, as the built-in "
    "cnn/resnet18/resnet34), since "
)


def check_tau(cfg: DictConfig) -> None:
    """``method.tau`` > 0; YAML's ``.inf`` (a string to Hydra's override grammar) means infinity."""
    tau = OmegaConf.select(cfg, "method.tau")
    if isinstance(tau, str) and tau.strip().lower() in (".inf", "+.inf"):
        tau = math.inf
        OmegaConf.update(cfg, "method.tau", tau)
    require(is_num(tau) and tau > 0, "method.tau", tau, "a number > 0 (inf or .inf for uniform weights)")


def check_rho(cfg: DictConfig, default: str = "null (the model's default) or an integer >= 0") -> None:
    rho = OmegaConf.select(cfg, "method.rho")
    require(rho is None or (is_int(rho) and rho >= 0), "method.rho", rho, default)


class MethodOptions:
    """What a method accepts of a config: its ``method`` group (:meth:`check`) and the models it
    runs on (:attr:`models`; :attr:`needs` says what a refused model lacks). One subclass per
    method, registered in :data:`OPTIONS` and declared by the method as ``Method.options``."""

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
    def pairs(cls) -> dict[str, tuple[tuple[str, ...], str]]:
        """Pair key (``method.name``, or ``fedavg/heterofl``) -> (models, needs)."""
        return {cls.name: (cls.models, cls.needs)}

    @classmethod
    def pair_key(cls, cfg: DictConfig) -> str:
        """The key of :meth:`pairs` that ``cfg`` runs under."""
        return cls.name


#: ``method.name`` -> its options (every method adds itself in :mod:`fedhm_flwr.config.options` and
#: declares them as ``Method.options``); this order is the order of the supported pairs in error messages.
OPTIONS: dict[str, type[MethodOptions]] = {}


def supported_pairs() -> str:
    """The supported (method, model) pairs of :data:`OPTIONS`, as error messages list them."""
    return "; ".join(f"{m}: {list(a)}" for o in OPTIONS.values() for m, (a, _) in o.pairs().items())
