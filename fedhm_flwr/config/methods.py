"""The (method, model) pairs a run accepts (:func:`validate_pair`), the user-model checks
(``model.target``) and the robust aggregations each method accepts; the per-method options
themselves are in :mod:`fedhm_flwr.config.options` (one ``MethodOptions`` class per method,
grouped by family; a method imports its class from the family's module).

The config check's torch-free path: the launcher checks a config before importing torch, and
``fedhm_flwr.models`` imports torch, so the few checks that need a model (a ``model.factorize``
rule, a user's ``model.target``, a pre-trained ViT checkpoint) import the models inside the
function, only on that path. These are the only imports inside functions of the config check.
"""

from __future__ import annotations

import copy
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.options import NEEDS, OPTIONS, SUPPORTED_MODELS, method_key, supported_pairs
from fedhm_flwr.config.options.groups import ARCH_NAMES, ModelGroup, parse_model
from fedhm_flwr.config.specs import backbone_choice, model_spec
from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.data.sources import dataset_info

__all__ = [
    "ARCH_NAMES",
    "robust_modes",
    "validate_pair",
    "validate_user_model",
    "with_user_model",
]


def with_user_model(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the user's model in place of the group's: where ``model.target`` is set, a copy
    whose ``model.arch`` is ``custom`` and ``model.width`` null (the model is the factory's, not a
    built-in one's width); else ``cfg`` itself. Applied once where a config is composed or resumed
    (:func:`fedhm_flwr.config.compose_config`, :func:`~fedhm_flwr.config.resume_config`), so that
    the saved ``config.yaml`` says what ran; the checks read a config through it and change nothing."""
    model = cfg.get("model")
    if model is None or OmegaConf.select(cfg, "model.target", default=None) is None:
        return cfg
    if model.get("arch") == "custom" and "width" in model and model.width is None:
        return cfg
    out = copy.deepcopy(cfg)
    OmegaConf.update(out, "model.arch", "custom")
    OmegaConf.update(out, "model.width", None, force_add=True)
    return out


def validate_user_model(cfg: DictConfig) -> ModelGroup:
    """The ``model`` group against its declaration (:func:`~fedhm_flwr.config.options.groups.parse_model`:
    ``model=custom`` needs a ``model.target``; ``model.kwargs``, ``model.static_bn``, ``model.factorize``),
    and a ``model.factorize`` rule's entries against the models' rules (the torch path: only when a
    rule is set). Changes nothing in ``cfg``."""
    plain = OmegaConf.to_container(cfg.model, resolve=True)
    model = parse_model(cast("dict[str, Any]", plain))  # a mapping: the group composed
    rule = model.factorize
    if rule is None or all(v is None for v in rule.values()):  # the model's defaults: nothing to check, no torch
        return model
    from fedhm_flwr.models.rules import rule_problem  # torch-free path: only a factorize rule imports the models

    problem = rule_problem(rule)
    if problem is not None:
        key, bad, allowed = problem
        raise ConfigError(f"model.factorize.{key}", bad, allowed)
    return model


def _check_custom_output(cfg: DictConfig) -> None:
    """A user model must load a state as a client does and give one logit per class of the dataset:
    built, loaded with its own state as plain tensors (strictly, and without ``state_dict()``'s
    ``_metadata``, as the arrays of a message arrive) and run in training mode on a batch of 2, on
    the meta device (no weights allocated) where its constructor runs there, else on the CPU with
    real weights (the meta device refuses some constructors that run anywhere else); a model that
    fails is reported with the error it raised."""
    try:
        spec = model_spec(cfg)
    except (OSError, ValueError, KeyError):  # data that cannot be read: the data check names it
        return
    import torch  # torch-free path: only a user's model is built during the check

    from fedhm_flwr.models import build_model, input_shape, shape_device

    shape = f"(N, {', '.join(map(str, input_shape(spec)))})"
    with shape_device(spec):
        try:
            model = build_model(spec, spectral_init=False)
        except Exception as err:  # noqa: BLE001 - any failure of the user's model is reported as such
            raise _model_failed(cfg, shape, err) from None
        try:
            model.load_state_dict(dict(model.state_dict()), strict=True)  # as a client loads what it receives
        except Exception as err:  # noqa: BLE001
            raise ConfigError(
                "model.target",
                cfg.model.target,
                "a factory whose model loads its own state dict as clients receive it (plain tensors "
                f"without state_dict()'s _metadata, strict keys); it failed with {type(err).__name__}: "
                f"{err}",
            ) from None
        try:
            out = model.train()(torch.zeros(2, *input_shape(spec)))
        except Exception as err:  # noqa: BLE001
            raise _model_failed(cfg, shape, err) from None
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise ConfigError(
            "model.target",
            cfg.model.target,
            f"a factory whose model returns the logits, one tensor of shape (N, classes), in training "
            f"mode too; it returned {what} for a batch of shape {shape} (e.g. turn auxiliary outputs "
            "off: model.kwargs.aux_logits=false)",
        )
    if out.shape[-1] != spec["num_classes"]:
        raise ConfigError(
            "model.kwargs.num_classes",
            OmegaConf.select(cfg, "model.kwargs.num_classes"),
            f"{spec['num_classes']}: dataset.name={cfg.dataset.name} has {spec['num_classes']} classes "
            f"and the model gives {out.shape[-1]} outputs",
        )


def _model_failed(cfg: DictConfig, shape: str, err: Exception) -> ConfigError:
    return ConfigError(
        "model.target",
        cfg.model.target,
        f"a factory whose model takes a batch of shape {shape} "
        f"(dataset.name={cfg.dataset.name}); it failed with {type(err).__name__}: {err}",
    )


def validate_pair(cfg: DictConfig) -> None:
    """Refuse a (method, model) pair outside :data:`SUPPORTED_MODELS`, listing the supported pairs."""
    key, arch = method_key(cfg), str(cfg.model.arch)
    allowed = SUPPORTED_MODELS[key]
    if arch not in allowed:
        field = "model.target" if arch == "custom" else "model.arch"
        value = cfg.model.target if arch == "custom" else arch
        what = "no model.target" if arch == "custom" else f"one of {list(allowed)}"
        method = "fedavg method.family=heterofl" if key == "fedavg/heterofl" else key
        raise ConfigError(
            field, value, f"for method={method}, {what}: it needs {NEEDS[key]}. Supported pairs: {supported_pairs()}"
        )
    if arch == "custom":
        from fedhm_flwr.models import resolve_target  # torch-free path; imports the user's module, calls nothing

        try:
            resolve_target(cfg.model.target)
        except ValueError as err:
            raise ConfigError("model.target", cfg.model.target, str(err).split("; allowed: ", 1)[-1]) from None
        if cfg.dataset.name == "sentiment":
            raise ConfigError("dataset.name", cfg.dataset.name, "an image dataset with a model.target")
        _check_custom_output(cfg)
    if arch == "vit" and key in ("fedhm", "fedavg"):
        if backbone_choice(cfg) == "pretrained":  # the server builds the initial model from it
            from fedhm_flwr.models.vit import DEFAULTS, arch_of, checkpoint_ref, resolve_ref  # torch-free path

            info = {k: cfg.model.get(k) or v for k, v in DEFAULTS.items()}
            path = resolve_ref(checkpoint_ref(arch_of({**info, **dataset_info(cfg.dataset.name)})))
            if not path.is_file():
                raise ConfigError(
                    "model.backbone",
                    "pretrained",
                    f"random (FedHM from scratch), or pretrained once `make pretrain` wrote {path}",
                )
        if cfg.dataset.name == "sentiment":
            raise ConfigError("dataset.name", cfg.dataset.name, "an image dataset with model=vit")


def robust_modes(cfg: DictConfig) -> tuple[str, ...]:
    """The ``aggregation.robust`` values ``cfg``'s method accepts
    (:meth:`~fedhm_flwr.config.options.base.MethodOptions.robust_modes`)."""
    return OPTIONS[str(cfg.method.name)].parse(cfg.method).robust_modes()
