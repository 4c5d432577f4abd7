"""Per-method validation: each method's options (the ``method`` group it accepts and the models it
runs on), one :class:`MethodOptions` subclass per method, grouped by family, and the (method,
model) pairs a run accepts.

Each method declares its validation: ``Method.options`` (``fedhm_flwr/server/methods/method.py``)
is one class of this package (:class:`FedHMOptions`, ...), whose :meth:`~MethodOptions.check`
refuses a bad ``method`` group and whose ``models`` / ``needs`` give the models the method runs
on; :data:`OPTIONS` maps ``method.name`` to them, and :data:`SUPPORTED_MODELS` is derived from it.
The checks are written here rather than in the method modules because a method module imports
torch and the config check must not (the launcher checks a config before importing torch;
``tests/test_shards.py`` and ``tests/test_user_models.py`` assert it), and config sits below the
method layer. The families: :mod:`~fedhm_flwr.config.options.factorized` (FedHM, PriSM),
:mod:`~fedhm_flwr.config.options.width` (HeteroFL, FedRolex, FjORD),
:mod:`~fedhm_flwr.config.options.fedavg` (FedAvg), :mod:`~fedhm_flwr.config.options.transformer`
(FedLoRA, HeteroTune); :mod:`~fedhm_flwr.config.options.base` holds the base class, the
registry and the parser. A ``MethodOptions`` class is also a frozen dataclass: an instance is the
method's typed ``method`` group (its fields the keys of ``conf/method/<name>.yaml``), part of the
run's :class:`~fedhm_flwr.config.options.run.RunOptions` (:mod:`~fedhm_flwr.config.options.run`: every
section the server reads, parsed once).
"""

from __future__ import annotations

from omegaconf import DictConfig

from fedhm_flwr.config.options.base import OPTIONS, MethodOptions, supported_pairs
from fedhm_flwr.config.options.factorized import FedHMOptions, PriSMOptions
from fedhm_flwr.config.options.fedavg import FedAvgOptions
from fedhm_flwr.config.options.run import RunOptions, run_options
from fedhm_flwr.config.options.transformer import FedLoRAOptions, HeteroTuneOptions, TransformerOptions
from fedhm_flwr.config.options.width import FedRolexOptions, FjORDOptions, HeteroFLOptions, WidthOptions

__all__ = [
    "NEEDS",
    "OPTIONS",
    "SUPPORTED_MODELS",
    "FedAvgOptions",
    "FedHMOptions",
    "FedLoRAOptions",
    "FedRolexOptions",
    "FjORDOptions",
    "HeteroFLOptions",
    "HeteroTuneOptions",
    "MethodOptions",
    "PriSMOptions",
    "RunOptions",
    "TransformerOptions",
    "WidthOptions",
    "method_key",
    "run_options",
    "supported_pairs",
]

# every method adds itself here and declares its options as ``Method.options``; this order is the
# order of the supported pairs in error messages
OPTIONS.update(
    (o.name, o)
    for o in (
        FedHMOptions,
        FedAvgOptions,
        HeteroFLOptions,
        FedRolexOptions,
        PriSMOptions,
        FedLoRAOptions,
        HeteroTuneOptions,
        FjORDOptions,
    )
)

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
