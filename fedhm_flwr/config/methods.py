"""Per-method validation (the ``method`` group of each algorithm), the (method, model) pairs a run
accepts and the user-model checks.

Each method declares its validation: ``Method.options`` (``fedhm_flwr/server/methods/method.py``)
is one :class:`MethodOptions` subclass of this module (:class:`FedHMOptions`, ...), whose
:meth:`~MethodOptions.check` refuses a bad ``method`` group and whose ``models`` / ``needs`` give
the models the method runs on; :data:`OPTIONS` maps ``method.name`` to them, and
:data:`SUPPORTED_MODELS` is derived from it. The checks are written here rather than in the
method modules because a method module imports torch and the config check must not (the
launcher checks a config before importing torch; ``tests/test_shards.py`` and
``tests/test_user_models.py`` assert it), and config sits below the method layer.

The config check's torch-free path: the launcher checks a config before importing torch, and
``fedhm_flwr.models`` imports torch, so the few checks that need a model (a ``model.factorize``
rule, a user's ``model.target``, a pre-trained ViT checkpoint) import the models inside the
function, only on that path. These are the only imports inside functions of the config check.
"""

from __future__ import annotations

import math
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf

from fedhm_flwr.config.checks import ROBUST, choice, flags, int_at_least, is_int, is_num, num_in, require
from fedhm_flwr.config.specs import backbone_choice, model_spec
from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.data.registry import dataset_info


def _check_tau(cfg: DictConfig) -> None:
    """``method.tau`` > 0; YAML's ``.inf`` (a string to Hydra's override grammar) means infinity."""
    tau = OmegaConf.select(cfg, "method.tau")
    if isinstance(tau, str) and tau.strip().lower() in (".inf", "+.inf"):
        tau = math.inf
        OmegaConf.update(cfg, "method.tau", tau)
    require(is_num(tau) and tau > 0, "method.tau", tau, "a number > 0 (inf or .inf for uniform weights)")


def _check_rho(cfg: DictConfig, default: str = "null (the model's default) or an integer >= 0") -> None:
    rho = OmegaConf.select(cfg, "method.rho")
    require(rho is None or (is_int(rho) and rho >= 0), "method.rho", rho, default)


CONV_ARCHS = ("cnn", "resnet18", "resnet34")
_BY_WIDTH = (
    "a model built by width (a constructor slicing channels by width_rate, as the built-in "
    "cnn/resnet18/resnet34), since "
)


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


class FedHMOptions(MethodOptions):
    name = "fedhm"
    models = (*CONV_ARCHS, "vit", "custom")
    needs = "Conv2d/Linear layers to factorize (cnn, resnet18, resnet34, vit, or a model.target)"

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        _check_tau(cfg)
        _check_rho(cfg)
        flags(
            cfg,
            "method.weight_by_samples",
            "method.frobenius_decay",
            "method.official_weights",
            "method.add_previous_global",
        )
        if OmegaConf.select(cfg, "method.svd_tolerance") is not None:  # absent from configs saved before it existed
            num_in(cfg, "method.svd_tolerance", 0.0, 1.0, low_open=True, high_open=True)


class WidthOptions(MethodOptions):
    """HeteroFL / FedRolex: levels are width rates in (0, 1] (checked with ``levels``)."""

    models = CONV_ARCHS

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        flags(cfg, "method.scaler")
        num_in(cfg, "method.grad_clip", 0.0, math.inf, high_open=True)
        flags(cfg, "method.weight_by_samples")


class HeteroFLOptions(WidthOptions):
    name = "heterofl"
    needs = _BY_WIDTH + "HeteroFL slices channel widths"


class FedRolexOptions(WidthOptions):
    name = "fedrolex"
    needs = _BY_WIDTH + "FedRolex rolls channel windows"


class FjORDOptions(MethodOptions):
    """FjORD: levels are p_max widths; the widths P drawn per batch (``method.p_values``, null:
    the levels' own), knowledge distillation, clipping, weights by sample count."""

    name = "fjord"
    models = CONV_ARCHS
    needs = _BY_WIDTH + "FjORD trains nested channel widths"

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        num_in(cfg, "method.grad_clip", 0.0, math.inf, high_open=True)
        flags(cfg, "method.weight_by_samples", "method.distill")
        p_values = OmegaConf.select(cfg, "method.p_values")
        if p_values is None:
            return
        ratios = list(OmegaConf.select(cfg, "levels.ratios") or [])
        match = OmegaConf.select(cfg, "levels.match") or "none"
        plain = list(p_values) if OmegaConf.is_list(p_values) else p_values
        require(
            match == "none",
            "method.p_values",
            plain,
            f"null with levels.match={match} (the widths drawn are then the matched rates)",
        )
        require(
            isinstance(plain, list)
            and plain
            and all(is_num(p) and 0 < p <= 1 for p in plain)
            and all(r in plain for r in ratios),
            "method.p_values",
            plain,
            f"null (the levels) or a list of widths in (0, 1] holding every level of levels.ratios {ratios}",
        )


class FedAvgOptions(MethodOptions):
    """Homogeneous FedAvg: the full model, or the smallest level of FedHM or HeteroFL; with
    ``method.family=heterofl`` it runs on HeteroFL's models (pair key ``fedavg/heterofl``)."""

    name = "fedavg"
    models = (*CONV_ARCHS, "vit", "custom")
    needs = "an image classifier (cnn, resnet18, resnet34, vit, or a model.target)"
    heterofl_models = CONV_ARCHS
    heterofl_needs = _BY_WIDTH + "method.family=heterofl slices widths"

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        choice(cfg, "method.variant", ("full", "smallest"))
        choice(cfg, "method.family", ("fedhm", "heterofl"))
        _check_rho(cfg)
        flags(cfg, "method.frobenius_decay", "method.scaler")
        num_in(cfg, "method.grad_clip", 0.0, math.inf, high_open=True)

    @classmethod
    def pairs(cls) -> dict[str, tuple[tuple[str, ...], str]]:
        return {**super().pairs(), "fedavg/heterofl": (cls.heterofl_models, cls.heterofl_needs)}

    @classmethod
    def pair_key(cls, cfg: DictConfig) -> str:
        return "fedavg/heterofl" if cfg.method.get("family") == "heterofl" else cls.name


class PriSMOptions(MethodOptions):
    """PriSM / OrthDrop: kernel selection rule, kappa, rho, the U-subset option (levels: keep ratios)."""

    name = "prism"
    models = CONV_ARCHS
    needs = "the built-in conv nets' kernel layout (cnn/resnet18/resnet34), since PriSM samples conv kernels"

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        choice(cfg, "method.sampling", ("prism", "orthdrop", "uniform", "softmax"))
        num_in(cfg, "method.kappa", 0.0, math.inf, high_open=True)
        _check_rho(cfg, "null (the model's FedHM default) or an integer >= 0 (0: every factorizable layer)")
        flags(cfg, "method.u_subset", "method.frobenius_decay")
        choice(cfg, "method.u_subset_rows", ("first", "random"))


class TransformerOptions(MethodOptions):
    """FedLoRA / HeteroTune: a transformer over a frozen pre-trained (or seeded random) backbone,
    trained by the client's own optimizer."""

    models = ("minilm", "vit")

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        arch = OmegaConf.select(cfg, "model.arch")
        require(
            arch in ("minilm", "vit"),
            "model.arch",
            arch,
            f"one of ['minilm', 'vit'] (method={cls.name} fine-tunes a transformer: add "
            "model=minilm dataset=sentiment, or model=vit dataset=fashion_mnist). "
            f"Supported pairs: {supported_pairs()}",
        )
        choice(cfg, "model.backbone", ("auto", "pretrained", "random"))
        int_at_least(cfg, "model.backbone_seed", 0)
        for field in ("model.depth", "model.heads"):
            value = OmegaConf.select(cfg, field)
            require(
                value is None or (is_int(value) and value >= 1),
                field,
                value,
                "null (the architecture's default) or an integer >= 1",
            )
        text = cfg.model.arch == "minilm"
        require(
            text == (cfg.dataset.name == "sentiment"),
            "dataset.name",
            cfg.dataset.name,
            f"'sentiment' with model=minilm, an image dataset with model=vit (method={cls.name})",
        )
        choice(cfg, "method.optimizer", ("adamw", "sgd"))
        lr = OmegaConf.select(cfg, "method.lr")
        require(lr is None or (is_num(lr) and 0 < lr < math.inf), "method.lr", lr, "null (train.lr) or a number > 0")


class FedLoRAOptions(TransformerOptions):
    """FedLoRA: LoRA ranks per level (or full fine-tuning), FedHM's softmax(gamma/tau) weights."""

    name = "fedlora"
    needs = "a transformer with LoRA targets (minilm, vit)"

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        super().check(cfg)
        choice(cfg, "method.mode", ("lora", "full"))
        int_at_least(cfg, "method.max_rank", 1)
        _check_tau(cfg)
        flags(cfg, "method.weight_by_samples")


class HeteroTuneOptions(TransformerOptions):
    """HeteroTune: model types by depth or width, DeMA bottleneck, bank and CMGA switches."""

    name = "heterotune"
    needs = "a transformer with DeMA slots (minilm, vit)"

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        super().check(cfg)
        choice(cfg, "method.scale", ("auto", "depth", "width"))
        if cfg.model.arch == "minilm":
            choice(cfg, "method.scale", ("auto", "depth"))  # the packaged MiniLM has one width
        int_at_least(cfg, "method.bottleneck", 1)
        flags(cfg, "method.bank", "method.cmga")
        num_in(cfg, "method.cmga_eps", 0.0, math.inf, high_open=True)
        scale = OmegaConf.select(cfg, "method.cmga_scale")
        require(
            scale is None or (is_num(scale) and scale > 0),
            "method.cmga_scale",
            scale,
            "null (c = ||G||_F / sqrt(N)) or a number > 0",
        )


#: ``method.name`` -> its options (every method adds itself here and declares them as ``Method.options``);
#: this order is the order of the supported pairs in error messages.
OPTIONS: dict[str, type[MethodOptions]] = {
    o.name: o
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
}

#: The (method, model) pairs a run accepts: pair key (``method.name``; ``fedavg/heterofl``: fedavg
#: with ``method.family=heterofl``) -> ``model.arch`` values (``custom``: a ``model.target``).
SUPPORTED_MODELS: dict[str, tuple[str, ...]] = {
    key: models for options in OPTIONS.values() for key, (models, _) in options.pairs().items()
}
#: What a method refusing a model would need from it (pair key -> text).
_NEEDS: dict[str, str] = {key: needs for options in OPTIONS.values() for key, (_, needs) in options.pairs().items()}


def method_key(cfg: DictConfig) -> str:
    """The key of :data:`SUPPORTED_MODELS` for ``cfg``'s method."""
    return OPTIONS[str(cfg.method.name)].pair_key(cfg)


def supported_pairs() -> str:
    return "; ".join(f"{m}: {list(a)}" for m, a in SUPPORTED_MODELS.items())


def validate_user_model(cfg: DictConfig) -> None:
    """``model.target`` (any model group): the user's model replaces the group's arch
    (``model.arch`` becomes ``custom``); ``model.kwargs``, ``model.static_bn``, ``model.factorize``."""
    target = OmegaConf.select(cfg, "model.target", default=None)
    arch = OmegaConf.select(cfg, "model.arch")
    if target is not None:
        OmegaConf.update(cfg, "model.arch", "custom")
        OmegaConf.update(cfg, "model.width", None, force_add=True)
    elif arch == "custom":
        require(
            False,
            "model.target",
            None,
            "'package.module:factory' with model=custom, "
            "e.g. model.target=torchvision.models:resnet18 model.kwargs.num_classes=10",
        )
    kwargs = OmegaConf.select(cfg, "model.kwargs", default={})
    require(
        kwargs is None or OmegaConf.is_dict(kwargs) or isinstance(kwargs, dict),
        "model.kwargs",
        kwargs,
        "a mapping of the factory's keyword arguments",
    )
    value = OmegaConf.select(cfg, "model.static_bn", default=False)
    require(isinstance(value, bool), "model.static_bn", value, "true or false")
    rule = OmegaConf.select(cfg, "model.factorize", default=None)
    if rule is not None:
        require(OmegaConf.is_dict(rule), "model.factorize", rule, "a mapping (include, exclude, types, ...)")
        values = OmegaConf.to_container(rule, resolve=True)
        if all(v is None for v in values.values()):  # the model's defaults: nothing to check (and no torch import)
            return
        from fedhm_flwr.models.rules import rule_problem  # torch-free path: only a factorize rule imports the models

        problem = rule_problem(values)
        if problem is not None:
            key, bad, allowed = problem
            raise ConfigError(f"model.factorize.{key}", bad, allowed)


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
            field, value, f"for method={method}, {what}: it needs {_NEEDS[key]}. Supported pairs: {supported_pairs()}"
        )
    if arch == "custom":
        from fedhm_flwr.models import resolve_target  # torch-free path; imports the user's module, calls nothing

        try:
            resolve_target(cfg.model.target)
        except ValueError as err:
            raise ConfigError("model.target", cfg.model.target, str(err).split("; allowed: ", 1)[-1]) from None
        require(
            cfg.dataset.name != "sentiment", "dataset.name", cfg.dataset.name, "an image dataset with a model.target"
        )
        _check_custom_output(cfg)
    if arch == "vit" and key in ("fedhm", "fedavg"):
        choice(cfg, "model.backbone", ("auto", "pretrained", "random"))
        if backbone_choice(cfg) == "pretrained":  # the server builds the initial model from it
            from fedhm_flwr.models.vit import DEFAULTS, arch_of, checkpoint_ref, resolve_ref  # torch-free path

            info = {k: cfg.model.get(k) or v for k, v in DEFAULTS.items()}
            path = resolve_ref(checkpoint_ref(arch_of({**info, **dataset_info(cfg.dataset.name)})))
            require(
                path.is_file(),
                "model.backbone",
                "pretrained",
                f"random (FedHM from scratch), or pretrained once `make pretrain` wrote {path}",
            )
        require(cfg.dataset.name != "sentiment", "dataset.name", cfg.dataset.name, "an image dataset with model=vit")


def robust_modes(cfg: DictConfig) -> tuple[str, ...]:
    """The ``aggregation.robust`` values a method accepts. Clipping, median and trimmed mean need
    a merge that is an element-wise (weighted) mean over the clients covering an element; Krum
    (and DP) need replies that all cover the whole model, as FedHM's recovered updates do."""
    name = cfg.method.name
    full_model = name in ("fedhm", "fedlora") or (
        name == "fedavg" and (cfg.method.variant == "full" or cfg.method.family == "fedhm")
    )
    if full_model:
        return ROBUST
    if name in ("heterofl", "fedrolex", "fedavg"):
        return ("none", "clip", "median", "trimmed_mean")
    return ("none",)  # prism, heterotune: the norm filter (aggregation.outlier_z) only


#: the keys of ``fedhm_flwr.models.ARCHS``, named here so that checking a config imports no torch
ARCH_NAMES = ("cnn", "resnet18", "resnet34", "minilm", "vit", "custom")
