"""Which layers FedHM factorizes, and at which rank: a PEFT-style rule (``target_modules`` with a few
more switches) and the hybrid plan (:func:`plan_ranks`).

Plain PyTorch, no Flower. A rule (config ``model.factorize``, a model's own defaults underneath)
selects layers in registration order (``named_modules``, which is forward order for the usual
models):

* ``types``: the layer classes considered, of ``Conv2d`` and ``Linear`` (exact classes: a
  subclass such as ``MultiheadAttention``'s ``out_proj``, which the attention reads as a raw
  weight, is never selected);
* ``include``: if non-empty, a layer's full dotted name must match one of these ``fnmatch``
  patterns (``*`` also crosses dots: ``blocks.*.attn.*``);
* ``exclude``: a layer whose name matches one of these patterns is left full (default
  :data:`SHORTCUT_PATTERNS`: residual shortcuts stay full, as FedHM keeps its 1×1 shortcuts);
* ``keep_first``: the first ``keep_first`` selected layers stay full rank (FedHM's ρ; null: the
  model's ``default_rho``, else :data:`DEFAULT_KEEP_FIRST`); ``method.rho`` overrides it;
* ``head`` (default ``false``): the classifier head (the layer producing the logits,
  :func:`head_name`: the model's ``classifier_name``, which a user's model gets by tracing a forward
  pass, convolutional or linear) is factorized only when true;
* ``pointwise`` (default ``true``): 1×1 convolutions are factorized too (a mobile network's
  layers are mostly 1×1 and depthwise: without them FedHM would leave it full size); their rank
  follows the linear rule (docs/METHODS.md#fedhm-ranks). The built-in CNN and ResNets set it false
  (the papers' plans).

Convolutions the factorized layer cannot express (groups > 1, i.e. depthwise/grouped; dilation;
non-square kernels, strides or paddings; non-zero padding modes) are never selected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from fnmatch import fnmatchcase
from typing import Any

from torch import Tensor, nn

from fedhm_flwr.math.lowrank import check_gamma, factors_fit, rank_for

from .layers import FactorizedConv2d, FactorizedLinear

#: Layer classes a rule may name in ``types``.
LAYER_TYPES: dict[str, type[nn.Module]] = {"Conv2d": nn.Conv2d, "Linear": nn.Linear}
#: ``keep_first`` of a model that declares no ``default_rho``: its first selected layer (for most
#: networks the stem) stays full, as FedHM keeps its first layers.
DEFAULT_KEEP_FIRST = 1
#: ``exclude`` of the plain rule: residual shortcuts (torchvision's ``downsample``, the usual
#: ``shortcut``) stay full, as FedHM keeps its ResNets' 1×1 shortcuts.
SHORTCUT_PATTERNS = ("*downsample*", "*shortcut*")
RULE_KEYS = ("include", "exclude", "types", "keep_first", "head", "pointwise")


@dataclass(frozen=True)
class FactorizeRule:
    """See the module docstring."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = SHORTCUT_PATTERNS
    types: tuple[str, ...] = ("Conv2d", "Linear")
    keep_first: int | None = None
    head: bool = False
    pointwise: bool = True

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any] | None, base: FactorizeRule | None = None, field: str = "model.factorize"
    ) -> FactorizeRule:
        """``base`` (default: the plain rule) with the non-null entries of ``values`` on top.

        Raises ``ValueError`` naming ``field.<key>`` and the allowed values on bad input
        (:func:`rule_problem`).
        """
        values = {k: v for k, v in dict(values or {}).items() if v is not None}
        problem = rule_problem(values)
        if problem is not None:
            key, value, allowed = problem
            raise ValueError(f"invalid config: {field}.{key}={value!r}; allowed: {allowed}")
        changes: dict[str, Any] = {
            k: (tuple(v) if k in ("include", "exclude", "types") else v) for k, v in values.items()
        }
        return replace(base or cls(), **changes)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (what a model spec carries)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


def rule_problem(values: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    """The first bad entry of a rule mapping (null entries are "the model's default") as
    ``(key, value, allowed)``, or None."""
    for key in values:
        if key not in RULE_KEYS:
            return key, values[key], f"one of the keys {list(RULE_KEYS)}"
    for key in ("include", "exclude", "types"):
        value = values.get(key)
        if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
            return key, value, "null or a list of strings"
    types = values.get("types")
    if types is not None and (not list(types) or any(t not in LAYER_TYPES for t in types)):
        return "types", list(types), f"null or a non-empty list of {list(LAYER_TYPES)}"
    keep = values.get("keep_first")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        return "keep_first", keep, "null (the model's default) or an integer >= 0"
    for key in ("head", "pointwise"):
        value = values.get(key)
        if value is not None and not isinstance(value, bool):
            return key, value, "null (the model's default), true or false"
    return None


def head_name(model: nn.Module, num_classes: int | None = None) -> str | None:
    """The layer producing the logits: ``model.classifier_name`` if the model names it (a user's
    model gets it from what a forward pass does: :func:`fedhm_flwr.models.custom.traced_head`,
    convolutional heads included), else the last ``Conv2d`` / ``Linear`` registered with
    ``num_classes`` outputs when that is given, else the last ``Linear`` registered (``fc`` of a
    torchvision ResNet, ``classifier.3`` of a MobileNet)."""
    named = getattr(model, "classifier_name", None)
    if named is not None:
        return str(named)
    last = matching = None
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            last = name
        if num_classes is not None and type(module) in (nn.Linear, nn.Conv2d):
            outputs = module.out_features if isinstance(module, nn.Linear) else module.out_channels
            matching = name if outputs == int(num_classes) else matching
    return matching or last


def conv_factorizable(conv: nn.Conv2d) -> bool:
    """Whether :class:`~fedhm_flwr.models.layers.FactorizedConv2d` can replace ``conv`` exactly."""

    def square(v: Any) -> bool:
        return isinstance(v, int) or (len(v) == 2 and v[0] == v[1])

    return (
        conv.groups == 1
        and tuple(conv.dilation) in ((1, 1), 1)
        and conv.padding_mode == "zeros"
        and isinstance(conv.padding, tuple)
        and square(conv.kernel_size)
        and square(conv.stride)
        and square(conv.padding)
    )


def _kernel(conv: nn.Conv2d) -> int:
    return conv.kernel_size if isinstance(conv.kernel_size, int) else int(conv.kernel_size[0])


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def model_rule(model: nn.Module) -> FactorizeRule:
    """The rule a model carries (``model.factorize_rule``: its class default, or the one
    :func:`fedhm_flwr.models.build_model` set from the spec), else the plain rule."""
    rule = getattr(model, "factorize_rule", None)
    return rule if isinstance(rule, FactorizeRule) else FactorizeRule()


def select_layers(model: nn.Module, rule: FactorizeRule | None = None) -> list[str]:
    """Names of the layers ``rule`` (default: :func:`model_rule`) selects, in registration order,
    before ``keep_first`` is applied."""
    rule = rule if rule is not None else model_rule(model)
    types = tuple(LAYER_TYPES[t] for t in rule.types)
    head = None if rule.head else head_name(model)
    out: list[str] = []
    inside: str | None = None  # an already factorized layer: its own a/b are not candidates
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        if isinstance(module, (FactorizedConv2d, FactorizedLinear)):
            inside = f"{name}."
            kind: type[nn.Module] = nn.Conv2d if isinstance(module, FactorizedConv2d) else nn.Linear
            k = module.kernel_size if isinstance(module, FactorizedConv2d) else 0
        elif type(module) in LAYER_TYPES.values():
            kind = type(module)
            if kind is nn.Conv2d and not conv_factorizable(module):
                continue
            k = _kernel(module) if kind is nn.Conv2d else 0
        else:
            continue
        if kind not in types or name == head or (k == 1 and not rule.pointwise):
            continue
        if rule.include and not _matches(name, rule.include):
            continue
        if rule.exclude and _matches(name, rule.exclude):
            continue
        out.append(name)
    return out


def keep_first(model: nn.Module, rule: FactorizeRule | None = None) -> int:
    """FedHM's default ρ for ``model``: the rule's ``keep_first``, else the model's
    ``default_rho``, else :data:`DEFAULT_KEEP_FIRST`."""
    rule = rule if rule is not None else model_rule(model)
    if rule.keep_first is not None:
        return int(rule.keep_first)
    return int(getattr(model, "default_rho", DEFAULT_KEEP_FIRST))


def _weight_shape(module: nn.Module) -> tuple[int, ...]:
    """Full weight shape of a plain or already factorized layer."""
    if isinstance(module, (FactorizedConv2d, FactorizedLinear)):
        return module.full_shape
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"{type(module).__name__} has no weight to factorize")
    return tuple(weight.shape)


def plan_ranks(model: nn.Module, gamma: float, rho: int | None = None) -> dict[str, int]:
    """Ranks of the hybrid ``[rho, L, gamma]`` network: ``{layer name: rank}``.

    The factorizable layers are those the model's rule selects, in forward order
    (:func:`select_layers`; any ``nn.Module``); ``rho`` (default: the
    rule's ``keep_first``, else the model's ``default_rho``) of them stay full rank, the rest get
    :func:`rank_for`, except a layer whose factors would hold more parameters than the layer
    (:func:`factors_fit`), which stays full at that level. ``gamma == 1`` means "send the model full
    rank": the plan is empty.
    """
    gamma = check_gamma(gamma)
    if rho is None:
        rho = keep_first(model)
    if isinstance(rho, bool) or not isinstance(rho, int) or rho < 0:
        raise ValueError(f"rho must be an int >= 0, got {rho!r}")
    if gamma == 1.0:
        return {}
    plan = {}
    for name in select_layers(model)[rho:]:
        shape = _weight_shape(model.get_submodule(name))
        rank = rank_for(shape, gamma)
        if factors_fit(shape, rank):  # else the layer stays full at this level (its factors would be larger)
            plan[name] = rank
    return plan
