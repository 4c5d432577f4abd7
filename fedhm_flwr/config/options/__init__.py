"""Per-method validation: each method's options (the ``method`` group it accepts and the models it
runs on), one :class:`MethodOptions` subclass per method, grouped by family, and the (method,
model) pairs a run accepts.

Each method declares its validation: ``Method.options`` (``fedhm_flwr/server/methods/method.py``)
is one class of this package (``FedHMOptions``, ...), whose :meth:`~MethodOptions.check`
refuses a bad ``method`` group and whose ``models`` / ``needs`` give the models the method runs
on. A class that sets its own ``name`` adds itself to :data:`OPTIONS` (``method.name`` -> class)
when its module is imported, and this package imports every such module; :data:`SUPPORTED_MODELS`
is derived from it, and the server's method registry (``server.registry.METHODS``) is checked
against it (``tests/test_registry.py``).
Each option is declared once, as a field of a frozen pydantic dataclass
(:mod:`~fedhm_flwr.config.options.declare`: type, default, allowed values, meaning; the shared
sections in :mod:`~fedhm_flwr.config.options.sections`, the model and dataset groups in
:mod:`~fedhm_flwr.config.options.groups`); ``conf/`` holds the same defaults
(``tests/test_declarations.py``).
The declarations are written here rather than in the method modules because a method module imports
torch and the config check must not (the launcher checks a config before importing torch;
``tests/test_shards.py`` and ``tests/test_user_models.py`` assert it), and config sits below the
method layer. The families: :mod:`~fedhm_flwr.config.options.factorized` (FedHM, PriSM),
:mod:`~fedhm_flwr.config.options.width` (HeteroFL, FedRolex, FjORD),
:mod:`~fedhm_flwr.config.options.fedavg` (FedAvg), :mod:`~fedhm_flwr.config.options.fiarse` (FIARSE),
:mod:`~fedhm_flwr.config.options.transformer`
(FedLoRA, HeteroTune); :mod:`~fedhm_flwr.config.options.base` holds the base class, the
table and the option types several methods share. A ``MethodOptions`` class is a frozen pydantic
dataclass: an instance is the
method's typed ``method`` group (its fields the keys of ``conf/method/<name>.yaml``), part of the
run's :class:`~fedhm_flwr.config.options.run.RunOptions` (:mod:`~fedhm_flwr.config.options.run`: every
section the server reads, parsed once).
"""

from __future__ import annotations

from omegaconf import DictConfig

# the modules of method options: importing one adds its methods to OPTIONS (MethodOptions.__init_subclass__),
# in this order (the order of the method list); a new module of options is imported here
from fedhm_flwr.config.options import factorized, fedavg, fiarse, transformer, width  # noqa: F401
from fedhm_flwr.config.options.base import OPTIONS, MethodOptions, supported_pairs
from fedhm_flwr.config.options.run import RunOptions, run_options

__all__ = [
    "NEEDS",
    "OPTIONS",
    "SUPPORTED_MODELS",
    "MethodOptions",
    "RunOptions",
    "method_key",
    "run_options",
    "supported_pairs",
]

#: The (method, model) pairs a run accepts: pair key (``method.name``; ``fedavg/heterofl``: fedavg
#: with ``method.family=heterofl``) -> ``model.arch`` values (``custom``: a ``model.target``).
SUPPORTED_MODELS: dict[str, tuple[str, ...]] = {
    key: models for options in OPTIONS.values() for key, (models, _) in options.pairs().items()
}
#: What a method refusing a model would need from it (pair key -> text).
NEEDS: dict[str, str] = {key: needs for options in OPTIONS.values() for key, (_, needs) in options.pairs().items()}


def method_key(cfg: DictConfig) -> str:
    """The key of :data:`SUPPORTED_MODELS` for ``cfg``'s method."""
    return OPTIONS[str(cfg.method.name)].pair_key(cfg)
