"""Compose the Hydra tree in ``conf/``, apply overrides and validate with clear errors.

Every entry point (the ServerApp, ``launch``, ``sweep``, ``inspect``) goes through
:func:`load_config`, so a bad value is refused the same way everywhere: one
:class:`ConfigError` naming the field and the allowed values, before any expensive work (Ray,
data loading, training) starts. No Flower import here.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedhm_flwr.protocol import WIRE_DTYPES  # float32 | float16 | bfloat16 (wire.dtype)

CONF_DIR = Path(os.environ.get("FEDHM_CONF_DIR", Path(__file__).resolve().parent.parent / "conf"))

PARTITION_SCHEMES = ("iid", "dirichlet", "pathological")
ASSIGNMENTS = ("fixed", "dynamic")
LEVEL_MATCH = ("none", "fedhm_params")  # heterofl / fedrolex widths: as given, or matched to FedHM's parameters
LR_SCHEDULES = ("constant", "cosine", "step")
BN_STATS = ("test_batch", "federated")
EVALUATION_WHERE = ("server", "clients", "both")
RAY_ADDRESS = re.compile(r"auto|[A-Za-z0-9][A-Za-z0-9.-]*:[0-9]{1,5}")  # simulation.ray_address (not null)


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"invalid config: {field}={value!r}; allowed: {allowed}")


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
    """Compose ``conf/config.yaml`` with Hydra overrides (no validation)."""
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
    return cfg


def _override_error(err: Exception, overrides: list[str]) -> ConfigError:
    """Turn Hydra's override errors into a ConfigError naming the offending key."""
    text = str(err).splitlines()[0]
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        if key and key in str(err):
            group = key.split(".")[0]
            options = _group_options(group)
            allowed = f"one of {options}" if options else "an existing key of conf/config.yaml"
            return ConfigError(key, item.split("=", 1)[-1], f"{allowed} ({text})")
    return ConfigError("overrides", " ".join(overrides), f"valid Hydra overrides ({text})")


def _group_options(group: str) -> list[str]:
    folder = CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_config(overrides: str | Sequence[str] | None = None) -> DictConfig:
    """Compose and validate: the one way every entry point obtains its configuration."""
    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def resume_config(run_dir: str | Path, overrides: str | Sequence[str] | None = None) -> DictConfig:
    """The configuration saved in ``run_dir`` (a run being resumed), with plain ``key=value``
    overrides on top (e.g. ``rounds=20`` to extend it), validated."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError("resume", str(run_dir), "a run directory holding config.yaml and checkpoint/")
    cfg = OmegaConf.load(saved)
    items = split_overrides(overrides)
    if items:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(items))
        except OmegaConfBaseException as err:
            raise ConfigError("overrides", " ".join(items), f"key=value pairs of existing keys ({err})") from None
    assert isinstance(cfg, DictConfig)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- validation


def _require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(field, value, allowed)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _choice(cfg: DictConfig, field: str, allowed: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, field)
    allowed = tuple(allowed)
    _require(value in allowed, field, value, f"one of {list(allowed)}")


def _int_at_least(cfg: DictConfig, field: str, low: int) -> None:
    value = OmegaConf.select(cfg, field)
    _require(_is_int(value) and value >= low, field, value, f"an integer >= {low}")


def _num_in(cfg: DictConfig, field: str, low: float, high: float, low_open: bool = False,
            high_open: bool = False) -> None:
    value = OmegaConf.select(cfg, field)
    ok = _is_num(value) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    _require(ok, field, value, f"a number in {lo}{low}, {high}{hi}")


def _validate_levels(cfg: DictConfig) -> None:
    ratios = OmegaConf.select(cfg, "levels.ratios")
    ratios = list(ratios) if OmegaConf.is_list(ratios) else ratios
    _require(isinstance(ratios, list) and len(ratios) > 0, "levels.ratios", ratios,
             "a non-empty list of numbers in (0, 1], largest first")
    for r in ratios:
        _require(_is_num(r) and 0 < r <= 1, "levels.ratios", ratios,
                 "a non-empty list of numbers in (0, 1], largest first")
    _require(all(a > b for a, b in zip(ratios, ratios[1:])), "levels.ratios", ratios,
             "distinct levels listed largest first, e.g. [1, 0.5, 0.25, 0.125]")
    props = OmegaConf.select(cfg, "levels.proportions")
    if props is None:  # equal shares
        props = [1] * len(ratios)
    props = list(props) if OmegaConf.is_list(props) else props
    _require(isinstance(props, list) and len(props) == len(ratios)
             and all(_is_num(p) and p >= 0 for p in props) and sum(props) > 0,
             "levels.proportions", props,
             f"null (equal shares) or {len(ratios)} non-negative numbers (one per level) with a positive sum")
    _choice(cfg, "levels.assignment", ASSIGNMENTS)
    if OmegaConf.select(cfg, "levels.match") is not None:  # absent from configs saved before it existed
        _choice(cfg, "levels.match", LEVEL_MATCH)
    default = OmegaConf.select(cfg, "levels.default")
    _require(default is None or default in ratios, "levels.default", default,
             f"null or one of levels.ratios {ratios}")


def _validate_tau(cfg: DictConfig) -> None:
    """``method.tau`` > 0; YAML's ``.inf`` (a string to Hydra's override grammar) means infinity."""
    tau = OmegaConf.select(cfg, "method.tau")
    if isinstance(tau, str) and tau.strip().lower() in (".inf", "+.inf"):
        tau = math.inf
        OmegaConf.update(cfg, "method.tau", tau)
    _require(_is_num(tau) and tau > 0, "method.tau", tau, "a number > 0 (inf or .inf for uniform weights)")


def _validate_fedhm(cfg: DictConfig) -> None:
    _validate_tau(cfg)
    rho = OmegaConf.select(cfg, "method.rho")
    _require(rho is None or (_is_int(rho) and rho >= 0), "method.rho", rho,
             "null (the model's default) or an integer >= 0")
    for flag in ("method.weight_by_samples", "method.frobenius_decay", "method.official_weights",
                 "method.add_previous_global"):
        value = OmegaConf.select(cfg, flag)
        _require(isinstance(value, bool), flag, value, "true or false")
    if OmegaConf.select(cfg, "method.svd_tolerance") is not None:  # absent from configs saved before it existed
        _num_in(cfg, "method.svd_tolerance", 0.0, 1.0, low_open=True, high_open=True)


def _validate_width(cfg: DictConfig) -> None:
    """HeteroFL / FedRolex: levels are width rates in (0, 1] (checked with ``levels``)."""
    value = OmegaConf.select(cfg, "method.scaler")
    _require(isinstance(value, bool), "method.scaler", value, "true or false")
    _num_in(cfg, "method.grad_clip", 0.0, math.inf, high_open=True)
    value = OmegaConf.select(cfg, "method.weight_by_samples")
    _require(isinstance(value, bool), "method.weight_by_samples", value, "true or false")


def _validate_fedavg(cfg: DictConfig) -> None:
    """Homogeneous FedAvg: the full model, or the smallest level of FedHM or HeteroFL."""
    _choice(cfg, "method.variant", ("full", "smallest"))
    _choice(cfg, "method.family", ("fedhm", "heterofl"))
    rho = OmegaConf.select(cfg, "method.rho")
    _require(rho is None or (_is_int(rho) and rho >= 0), "method.rho", rho,
             "null (the model's default) or an integer >= 0")
    for flag in ("method.frobenius_decay", "method.scaler"):
        value = OmegaConf.select(cfg, flag)
        _require(isinstance(value, bool), flag, value, "true or false")
    _num_in(cfg, "method.grad_clip", 0.0, math.inf, high_open=True)


def backbone_choice(cfg: DictConfig) -> str:
    """``model.backbone`` as used: ``auto`` is ``pretrained`` for the fine-tuning methods (FedLoRA,
    HeteroTune) and ``random`` for the methods that train the whole model from scratch (FedHM,
    FedAvg), as the FedHM papers train theirs."""
    value = str(cfg.model.get("backbone", "pretrained"))
    if value == "auto":
        return "random" if cfg.method.name in ("fedhm", "fedavg") else "pretrained"
    return value


def _validate_transformer(cfg: DictConfig, method: str) -> None:
    """FedLoRA / HeteroTune: a transformer over a frozen pre-trained (or seeded random) backbone."""
    arch = OmegaConf.select(cfg, "model.arch")
    _require(arch in ("minilm", "vit"), "model.arch", arch,
             f"one of ['minilm', 'vit'] (method={method} fine-tunes a transformer: add "
             "model=minilm dataset=sentiment, or model=vit dataset=fashion_mnist). "
             f"Supported pairs: {supported_pairs()}")
    _choice(cfg, "model.backbone", ("auto", "pretrained", "random"))
    _int_at_least(cfg, "model.backbone_seed", 0)
    for field in ("model.depth", "model.heads"):
        value = OmegaConf.select(cfg, field)
        _require(value is None or (_is_int(value) and value >= 1), field, value,
                 "null (the architecture's default) or an integer >= 1")
    text = cfg.model.arch == "minilm"
    _require(text == (cfg.dataset.name == "sentiment"), "dataset.name", cfg.dataset.name,
             f"'sentiment' with model=minilm, an image dataset with model=vit (method={method})")


def _validate_client_optimizer(cfg: DictConfig) -> None:
    _choice(cfg, "method.optimizer", ("adamw", "sgd"))
    lr = OmegaConf.select(cfg, "method.lr")
    _require(lr is None or (_is_num(lr) and 0 < lr < math.inf), "method.lr", lr,
             "null (train.lr) or a number > 0")


def _validate_fedlora(cfg: DictConfig) -> None:
    """FedLoRA: LoRA ranks per level (or full fine-tuning), FedHM's softmax(gamma/tau) weights."""
    _validate_transformer(cfg, "fedlora")
    _validate_client_optimizer(cfg)
    _choice(cfg, "method.mode", ("lora", "full"))
    _int_at_least(cfg, "method.max_rank", 1)
    _validate_tau(cfg)
    value = OmegaConf.select(cfg, "method.weight_by_samples")
    _require(isinstance(value, bool), "method.weight_by_samples", value, "true or false")


def _validate_heterotune(cfg: DictConfig) -> None:
    """HeteroTune: model types by depth or width, DeMA bottleneck, bank and CMGA switches."""
    _validate_transformer(cfg, "heterotune")
    _validate_client_optimizer(cfg)
    _choice(cfg, "method.scale", ("auto", "depth", "width"))
    if cfg.model.arch == "minilm":
        _choice(cfg, "method.scale", ("auto", "depth"))  # the packaged MiniLM has one width
    _int_at_least(cfg, "method.bottleneck", 1)
    for flag in ("method.bank", "method.cmga"):
        value = OmegaConf.select(cfg, flag)
        _require(isinstance(value, bool), flag, value, "true or false")
    _num_in(cfg, "method.cmga_eps", 0.0, math.inf, high_open=True)
    scale = OmegaConf.select(cfg, "method.cmga_scale")
    _require(scale is None or (_is_num(scale) and scale > 0), "method.cmga_scale", scale,
             "null (c = ||G||_F / sqrt(N)) or a number > 0")


def _validate_prism(cfg: DictConfig) -> None:
    """PriSM / OrthDrop: kernel selection rule, kappa, rho, the U-subset option (levels: keep ratios)."""
    _choice(cfg, "method.sampling", ("prism", "orthdrop", "uniform", "softmax"))
    _num_in(cfg, "method.kappa", 0.0, math.inf, high_open=True)
    rho = OmegaConf.select(cfg, "method.rho")
    _require(rho is None or (_is_int(rho) and rho >= 0), "method.rho", rho,
             "null (the model's FedHM default) or an integer >= 0 (0: every factorizable layer)")
    for flag in ("method.u_subset", "method.frobenius_decay"):
        value = OmegaConf.select(cfg, flag)
        _require(isinstance(value, bool), flag, value, "true or false")
    _choice(cfg, "method.u_subset_rows", ("first", "random"))


CONV_ARCHS = ("cnn", "resnet18", "resnet34")
#: The (method, model) pairs a run accepts: method (``fedavg/heterofl``: fedavg with
#: ``method.family=heterofl``) -> ``model.arch`` values (``custom``: a ``model.target``).
SUPPORTED_MODELS: dict[str, tuple[str, ...]] = {
    "fedhm": (*CONV_ARCHS, "vit", "custom"),
    "fedavg": (*CONV_ARCHS, "vit", "custom"),
    "fedavg/heterofl": CONV_ARCHS,
    "heterofl": CONV_ARCHS,
    "fedrolex": CONV_ARCHS,
    "prism": CONV_ARCHS,
    "fedlora": ("minilm", "vit"),
    "heterotune": ("minilm", "vit"),
}
#: What a method refusing a model would need from it.
_NEEDS = {
    "fedavg/heterofl": "a model built by width (a constructor slicing channels by width_rate, as the built-in "
                       "cnn/resnet18/resnet34), since method.family=heterofl slices widths",
    "heterofl": "a model built by width (a constructor slicing channels by width_rate, as the built-in "
                "cnn/resnet18/resnet34), since HeteroFL slices channel widths",
    "fedrolex": "a model built by width (a constructor slicing channels by width_rate, as the built-in "
                "cnn/resnet18/resnet34), since FedRolex rolls channel windows",
    "prism": "the built-in conv nets' kernel layout (cnn/resnet18/resnet34), since PriSM samples conv kernels",
    "fedlora": "a transformer with LoRA targets (minilm, vit)",
    "heterotune": "a transformer with DeMA slots (minilm, vit)",
    "fedhm": "Conv2d/Linear layers to factorize (cnn, resnet18, resnet34, vit, or a model.target)",
    "fedavg": "an image classifier (cnn, resnet18, resnet34, vit, or a model.target)",
}


def method_key(cfg: DictConfig) -> str:
    """The key of :data:`SUPPORTED_MODELS` for ``cfg``'s method."""
    name = str(cfg.method.name)
    return "fedavg/heterofl" if name == "fedavg" and cfg.method.get("family") == "heterofl" else name


def supported_pairs() -> str:
    return "; ".join(f"{m}: {list(a)}" for m, a in SUPPORTED_MODELS.items())


def _validate_user_model(cfg: DictConfig) -> None:
    """``model.target`` (any model group): the user's model replaces the group's arch
    (``model.arch`` becomes ``custom``); ``model.kwargs``, ``model.static_bn``, ``model.factorize``."""
    target = OmegaConf.select(cfg, "model.target", default=None)
    arch = OmegaConf.select(cfg, "model.arch")
    if target is not None:
        OmegaConf.update(cfg, "model.arch", "custom")
        OmegaConf.update(cfg, "model.width", None, force_add=True)
    elif arch == "custom":
        _require(False, "model.target", None, "'package.module:factory' with model=custom, "
                 "e.g. model.target=torchvision.models:resnet18 model.kwargs.num_classes=10")
    kwargs = OmegaConf.select(cfg, "model.kwargs", default={})
    _require(kwargs is None or OmegaConf.is_dict(kwargs) or isinstance(kwargs, dict), "model.kwargs", kwargs,
             "a mapping of the factory's keyword arguments")
    value = OmegaConf.select(cfg, "model.static_bn", default=False)
    _require(isinstance(value, bool), "model.static_bn", value, "true or false")
    rule = OmegaConf.select(cfg, "model.factorize", default=None)
    if rule is not None:
        _require(OmegaConf.is_dict(rule), "model.factorize", rule, "a mapping (include, exclude, types, ...)")
        values = OmegaConf.to_container(rule, resolve=True)
        if all(v is None for v in values.values()):  # the model's defaults: nothing to check (and no torch import)
            return
        from fedhm_flwr.models.rules import rule_problem

        problem = rule_problem(values)
        if problem is not None:
            key, bad, allowed = problem
            raise ConfigError(f"model.factorize.{key}", bad, allowed)


def _check_custom_output(cfg: DictConfig) -> None:
    """A user model must give one logit per class of the dataset: built and run on a batch of 2,
    on the meta device (no weights allocated) where its constructor runs there, else on the CPU
    with real weights (the meta device refuses some constructors that run anywhere else); a model
    that fails is reported with the error it raised."""
    try:
        spec = model_spec(cfg)
    except (OSError, ValueError, KeyError):  # data that cannot be read: the data check names it
        return
    import torch

    from fedhm_flwr.models import build_model, input_shape, shape_device

    try:
        with shape_device(spec):
            out = build_model(spec, spectral_init=False)(torch.zeros(2, *input_shape(spec)))
    except Exception as err:  # noqa: BLE001 - any failure of the user's model is reported as such
        raise ConfigError("model.target", cfg.model.target,
                          f"a factory whose model takes a batch of shape (N, {', '.join(map(str, input_shape(spec)))}) "
                          f"(dataset.name={cfg.dataset.name}); it failed with {type(err).__name__}: {err}") from None
    if isinstance(out, torch.Tensor) and out.shape[-1] != spec["num_classes"]:
        raise ConfigError("model.kwargs.num_classes", OmegaConf.select(cfg, "model.kwargs.num_classes"),
                          f"{spec['num_classes']}: dataset.name={cfg.dataset.name} has {spec['num_classes']} classes "
                          f"and the model gives {out.shape[-1]} outputs")


def _validate_pair(cfg: DictConfig) -> None:
    """Refuse a (method, model) pair outside :data:`SUPPORTED_MODELS`, listing the supported pairs."""
    key, arch = method_key(cfg), str(cfg.model.arch)
    allowed = SUPPORTED_MODELS[key]
    if arch not in allowed:
        field = "model.target" if arch == "custom" else "model.arch"
        value = cfg.model.target if arch == "custom" else arch
        what = "no model.target" if arch == "custom" else f"one of {list(allowed)}"
        method = "fedavg method.family=heterofl" if key == "fedavg/heterofl" else key
        raise ConfigError(field, value, f"for method={method}, {what}: it needs {_NEEDS[key]}. "
                          f"Supported pairs: {supported_pairs()}")
    if arch == "custom":
        from fedhm_flwr.models import resolve_target  # imports the module, calls nothing

        try:
            resolve_target(cfg.model.target)
        except ValueError as err:
            raise ConfigError("model.target", cfg.model.target, str(err).split("; allowed: ", 1)[-1]) from None
        _require(cfg.dataset.name != "sentiment", "dataset.name", cfg.dataset.name,
                 "an image dataset with a model.target")
        _check_custom_output(cfg)
    if arch == "vit" and key in ("fedhm", "fedavg"):
        _choice(cfg, "model.backbone", ("auto", "pretrained", "random"))
        if backbone_choice(cfg) == "pretrained":  # the server builds the initial model from it
            from fedhm_flwr.models.vit import DEFAULTS, arch_of, checkpoint_ref, resolve_ref

            info = {k: cfg.model.get(k) or v for k, v in DEFAULTS.items()}
            from fedhm_flwr.data import dataset_info

            path = resolve_ref(checkpoint_ref(arch_of({**info, **dataset_info(cfg.dataset.name)})))
            _require(path.is_file(), "model.backbone", "pretrained",
                     f"random (FedHM from scratch), or pretrained once `make pretrain` wrote {path}")
        _require(cfg.dataset.name != "sentiment", "dataset.name", cfg.dataset.name, "an image dataset with model=vit")


#: method name -> validator of the ``method`` group (every method adds itself here).
METHOD_VALIDATORS: dict[str, Callable[[DictConfig], None]] = {
    "prism": _validate_prism,
    "fedhm": _validate_fedhm,
    "heterofl": _validate_width,
    "fedrolex": _validate_width,
    "fedavg": _validate_fedavg,
    "fedlora": _validate_fedlora,
    "heterotune": _validate_heterotune,
}


def _validate_source(cfg: DictConfig) -> None:
    """A folder source's options (``dataset.path``, ``dataset.image_size``, ...): the data spec's rules."""
    from fedhm_flwr.data.spec import SOURCE_DEFAULTS, source_field_problem

    if cfg.dataset.name not in SOURCE_DEFAULTS:
        return
    for key, default in SOURCE_DEFAULTS[cfg.dataset.name].items():
        value = cfg.dataset.get(key, default)
        problem = source_field_problem(key, value)
        _require(problem is None, f"dataset.{key}", value, str(problem))
    data_dir = cfg.dataset.get("data_dir")
    _require(data_dir is None, "dataset.data_dir", data_dir, "null: dataset.path says where the data is")


#: the keys of ``fedhm_flwr.models.ARCHS``, named here so that checking a config imports no torch
ARCH_NAMES = ("cnn", "resnet18", "resnet34", "minilm", "vit", "custom")


def validate(cfg: DictConfig) -> None:
    """Refuse the first invalid value with a :class:`ConfigError` naming the field."""
    from fedhm_flwr.data import DATASETS, EXTERNAL_DATASETS, FOLDER_SOURCES  # local imports keep `import config` light

    _choice(cfg, "method.name", METHOD_VALIDATORS)
    _validate_user_model(cfg)
    METHOD_VALIDATORS[cfg.method.name](cfg)
    _choice(cfg, "model.arch", ARCH_NAMES)
    _validate_pair(cfg)
    width = OmegaConf.select(cfg, "model.width")
    _require(width is None or (_is_int(width) and width >= 1), "model.width", width,
             "null (the architecture's default) or an integer >= 1")
    _choice(cfg, "dataset.name", [*DATASETS, *EXTERNAL_DATASETS, *FOLDER_SOURCES])
    _validate_source(cfg)
    for field in ("dataset.max_train_examples", "dataset.max_test_examples"):
        _int_at_least(cfg, field, 0)
    _int_at_least(cfg, "seed", 0)
    _int_at_least(cfg, "rounds", 1)
    _int_at_least(cfg, "num_clients", 1)
    _num_in(cfg, "fraction_train", 0.0, 1.0, low_open=True)
    _int_at_least(cfg, "min_train_nodes", 1)
    _num_in(cfg, "timeout", 0.0, math.inf, low_open=True)
    _int_at_least(cfg, "availability.min_nodes", 0)
    _num_in(cfg, "availability.wait_seconds", 0.0, math.inf, high_open=True)
    _choice(cfg, "availability.on_timeout", ("continue", "stop"))
    _num_in(cfg, "availability.poll_seconds", 0.0, math.inf, low_open=True, high_open=True)
    _choice(cfg, "availability.query", ("all", "sampled"))
    _choice(cfg, "wire.dtype", WIRE_DTYPES)
    _validate_levels(cfg)
    _choice(cfg, "partition.scheme", PARTITION_SCHEMES)
    _num_in(cfg, "partition.alpha", 0.0, math.inf, low_open=True, high_open=True)
    _int_at_least(cfg, "partition.classes_per_partition", 1)
    _int_at_least(cfg, "train.local_epochs", 1)
    _int_at_least(cfg, "train.batch_size", 1)
    _num_in(cfg, "train.lr", 0.0, math.inf, low_open=True, high_open=True)
    _choice(cfg, "train.lr_schedule", LR_SCHEDULES)
    _num_in(cfg, "train.lr_gamma", 0.0, 1.0, low_open=True)
    steps = OmegaConf.select(cfg, "train.lr_step_rounds")
    _require(OmegaConf.is_list(steps) and all(_is_num(s) and 0 < s < 1 for s in steps),
             "train.lr_step_rounds", steps, "a list of fractions of the run in (0, 1)")
    _num_in(cfg, "train.momentum", 0.0, 1.0, high_open=True)
    _num_in(cfg, "train.weight_decay", 0.0, math.inf, high_open=True)
    _num_in(cfg, "train.grad_clip", 0.0, math.inf, high_open=True)
    masked = OmegaConf.select(cfg, "train.masked_ce")
    _require(isinstance(masked, bool), "train.masked_ce", masked, "true or false")
    if OmegaConf.select(cfg, "train.distill") is not None:  # absent from configs saved before it existed
        enabled = OmegaConf.select(cfg, "train.distill.enabled")
        _require(isinstance(enabled, bool), "train.distill.enabled", enabled, "true or false")
        _num_in(cfg, "train.distill.temperature", 0.0, math.inf, low_open=True, high_open=True)
        _num_in(cfg, "train.distill.weight", 0.0, math.inf, high_open=True)
    _int_at_least(cfg, "evaluation.every", 1)
    _int_at_least(cfg, "evaluation.batch_size", 1)
    _choice(cfg, "evaluation.bn_stats", BN_STATS)
    _int_at_least(cfg, "evaluation.bn_clients", 0)
    deploy = OmegaConf.select(cfg, "evaluation.deploy_stats", default=True)  # absent from configs saved before it existed
    _require(isinstance(deploy, bool), "evaluation.deploy_stats", deploy, "true or false")
    _choice(cfg, "evaluation.where", EVALUATION_WHERE)
    _num_in(cfg, "evaluation.holdout", 0.0, 1.0, high_open=True)
    _require(cfg.evaluation.where == "server" or cfg.evaluation.holdout > 0, "evaluation.holdout",
             cfg.evaluation.holdout, f"a fraction in (0, 1) when evaluation.where={cfg.evaluation.where}")
    _num_in(cfg, "simulation.num_cpus", 0.0, math.inf, low_open=True, high_open=True)
    _num_in(cfg, "simulation.num_gpus", 0.0, math.inf, high_open=True)
    ray_address = OmegaConf.select(cfg, "simulation.ray_address")  # absent from configs saved before it existed
    _require(ray_address is None or (isinstance(ray_address, str) and RAY_ADDRESS.fullmatch(ray_address) is not None),
             "simulation.ray_address", ray_address,
             "null (a private Ray instance), auto (the cluster this machine belongs to) or HOST:PORT of a Ray "
             "cluster's head (its GCS port, 6379 by default)")
    _int_at_least(cfg, "checkpoint.every", 0)
    keep_best = OmegaConf.select(cfg, "checkpoint.keep_best", default=False)  # absent from older saved configs
    _require(isinstance(keep_best, bool), "checkpoint.keep_best", keep_best, "true or false")
    _num_in(cfg, "failures.crash_probability", 0.0, 1.0)
    _num_in(cfg, "failures.slow_probability", 0.0, 1.0)
    _num_in(cfg, "failures.slow_seconds", 0.0, math.inf, high_open=True)
    _validate_untrusted(cfg)
    _validate_tracking(cfg)
    out = OmegaConf.select(cfg, "output_dir")
    _require(out is None or (isinstance(out, str) and Path(out).is_absolute()), "output_dir", out,
             "null or an absolute path")


ATTACKS = ("none", "scale", "sign_flip", "label_flip", "gaussian")
ROBUST = ("none", "clip", "median", "trimmed_mean", "krum")


def robust_modes(cfg: DictConfig) -> tuple[str, ...]:
    """The ``aggregation.robust`` values a method accepts. Clipping, median and trimmed mean need
    a merge that is an element-wise (weighted) mean over the clients covering an element; Krum
    (and DP) need replies that all cover the whole model, as FedHM's recovered updates do."""
    name = cfg.method.name
    full_model = name in ("fedhm", "fedlora") or (name == "fedavg" and (
        cfg.method.variant == "full" or cfg.method.family == "fedhm"))
    if full_model:
        return ROBUST
    if name in ("heterofl", "fedrolex", "fedavg"):
        return ("none", "clip", "median", "trimmed_mean")
    return ("none",)  # prism, heterotune: the norm filter (aggregation.outlier_z) only


def _validate_untrusted(cfg: DictConfig) -> None:
    """``failures.attack``, ``aggregation`` and ``dp``."""
    _choice(cfg, "failures.attack.kind", ATTACKS)
    _num_in(cfg, "failures.attack.fraction", 0.0, 1.0)
    _num_in(cfg, "failures.attack.scale", -math.inf, math.inf, low_open=True, high_open=True)
    modes = robust_modes(cfg)
    mode = OmegaConf.select(cfg, "aggregation.robust")
    _require(mode in modes, "aggregation.robust", mode,
             f"one of {list(modes)} for method={cfg.method.name}" + (
                 " (krum needs replies that cover the whole model)" if mode == "krum" else ""))
    _num_in(cfg, "aggregation.clip_norm", 0.0, math.inf, high_open=True)
    _num_in(cfg, "aggregation.clip_quantile", 0.0, 1.0, low_open=True)
    _num_in(cfg, "aggregation.trim_fraction", 0.0, 0.5, high_open=True)
    _int_at_least(cfg, "aggregation.krum_f", 0)
    _int_at_least(cfg, "aggregation.krum_m", 1)
    _num_in(cfg, "aggregation.outlier_z", 0.0, math.inf, high_open=True)
    if OmegaConf.select(cfg, "aggregation.max_norm") is not None:  # configs saved before the key: 1e6
        _num_in(cfg, "aggregation.max_norm", 0.0, 1e15, low_open=True)  # bound² stays far below float32's max
    dp_seed = OmegaConf.select(cfg, "dp.seed")
    _require(dp_seed is None or (isinstance(dp_seed, int) and not isinstance(dp_seed, bool) and dp_seed >= 0),
             "dp.seed", dp_seed, "null (OS entropy: the private setting) or an integer >= 0 (reproducible, not private)")
    enabled = OmegaConf.select(cfg, "dp.enabled")
    _require(isinstance(enabled, bool), "dp.enabled", enabled, "true or false")
    _num_in(cfg, "dp.clip", 0.0, math.inf, low_open=True, high_open=True)
    _num_in(cfg, "dp.noise_multiplier", 0.0, math.inf, low_open=True, high_open=True)
    _num_in(cfg, "dp.delta", 0.0, 1.0, low_open=True, high_open=True)
    if enabled:
        _require("krum" in modes, "dp.enabled", enabled,
                 f"false for method={cfg.method.name} (DP needs replies that cover the whole model: "
                 "fedhm, fedlora, fedavg with variant=full or family=fedhm)")
        _require(mode == "none" and float(cfg.aggregation.outlier_z) == 0, "aggregation.robust", mode,
                 "none, with aggregation.outlier_z=0, when dp.enabled (DP clips itself; a data-dependent "
                 "filter is outside the accountant)")
def _validate_tracking(cfg: DictConfig) -> None:
    """``tracking.*`` (a config saved before the section existed gets its defaults)."""
    for flag in ("tracking.tensorboard", "tracking.mlflow"):
        value = OmegaConf.select(cfg, flag, default=flag.endswith("tensorboard"))
        _require(isinstance(value, bool), flag, value, "true or false")
    uri = OmegaConf.select(cfg, "tracking.mlflow_uri", default=None)
    _require(uri is None or (isinstance(uri, str) and uri != ""), "tracking.mlflow_uri", uri,
             "null (a file store in <run dir>/mlruns) or an MLflow tracking URI")
    if OmegaConf.select(cfg, "tracking.mlflow", default=False):
        from importlib.util import find_spec  # refused before the run starts, not after round 1

        _require(find_spec("mlflow") is not None, "tracking.mlflow", True,
                 "false, or true with MLflow installed: pip install 'fedhm-flwr[mlflow]'")


# --------------------------------------------------------------------------- derived specs


def level_proportions(cfg: DictConfig) -> list[float]:
    """The levels' shares of clients (``levels.proportions``; null = equal shares)."""
    props = cfg.levels.proportions
    return [1.0] * len(cfg.levels.ratios) if props is None else [float(p) for p in props]


def model_spec(cfg: DictConfig) -> dict[str, Any]:
    """The full (global) model's spec: what ``models.build_model`` needs, as plain JSON types."""
    from fedhm_flwr.data import dataset_info

    info = dataset_info(cfg.dataset.name, data_spec(cfg))  # a folder source's classes are read from dataset.path
    spec = {"arch": cfg.model.arch, **{k: int(v) for k, v in info.items()}}  # image: classes, channels, size
    if cfg.model.get("width") is not None:
        spec["width"] = int(cfg.model.width)
    if cfg.model.arch == "custom":
        spec["target"] = str(cfg.model.target)
        spec["kwargs"] = OmegaConf.to_container(cfg.model.kwargs, resolve=True) if cfg.model.get("kwargs") else {}
    rule = cfg.model.get("factorize")
    rule = {k: v for k, v in OmegaConf.to_container(rule, resolve=True).items() if v is not None} if rule else {}
    if rule:
        spec["factorize"] = rule
    if cfg.model.arch == "custom" and cfg.model.get("static_bn", False):  # built-in models are always sBN
        spec["static_bn"] = True
    if cfg.model.arch == "vit" and cfg.method.name in ("fedhm", "fedavg"):  # the whole ViT trains (FedHM)
        from fedhm_flwr.models.vit import DEFAULTS, arch_of, checkpoint_ref

        for key in DEFAULTS:
            spec[key] = int(cfg.model.get(key) or DEFAULTS[key])
        spec["backbone_seed"] = int(cfg.model.get("backbone_seed", 0) or 0)
        pretrained = backbone_choice(cfg) == "pretrained"
        spec["backbone"] = checkpoint_ref(arch_of(spec)) if pretrained else "random"
        spec["train_backbone"] = True
    return spec


def data_spec(cfg: DictConfig, num_partitions: int | None = None) -> dict[str, Any]:
    """What a client needs to find its partition (its data location comes from its node)."""
    return {
        "name": cfg.dataset.name,
        "scheme": cfg.partition.scheme,
        "num_partitions": int(num_partitions if num_partitions is not None else cfg.num_clients),
        "alpha": float(cfg.partition.alpha),
        "classes_per_partition": int(cfg.partition.classes_per_partition),
        "seed": int(cfg.seed),
        "max_train_examples": int(cfg.dataset.max_train_examples),
        "max_test_examples": int(cfg.dataset.max_test_examples),
        "augment": bool(cfg.dataset.augment),
        "download": bool(cfg.dataset.download),
        "holdout": holdout_fraction(cfg),
        **source_options(cfg),
    }


def source_options(cfg: DictConfig) -> dict[str, Any]:
    """A folder source's options (``dataset.path``, ``dataset.image_size``, ...; none for the others)."""
    from fedhm_flwr.data.spec import SOURCE_DEFAULTS

    return {key: cfg.dataset.get(key, default) for key, default in SOURCE_DEFAULTS.get(cfg.dataset.name, {}).items()}


def holdout_fraction(cfg: DictConfig) -> float:
    """The fraction of each node's examples held out for client-side evaluation: the configured
    ``evaluation.holdout`` when clients evaluate, else 0 (nodes train on all their examples)."""
    return float(cfg.evaluation.holdout) if cfg.evaluation.where in ("clients", "both") else 0.0


def learning_rate(cfg: DictConfig, server_round: int) -> float:
    """The round's learning rate under the configured schedule (rounds start at 1)."""
    base, total = float(cfg.train.lr), int(cfg.rounds)
    schedule = cfg.train.lr_schedule
    if schedule == "cosine":
        return 0.5 * base * (1 + math.cos(math.pi * (server_round - 1) / max(1, total)))
    if schedule == "step":
        passed = sum(server_round > f * total for f in cfg.train.lr_step_rounds)
        return base * float(cfg.train.lr_gamma) ** passed
    return base


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
