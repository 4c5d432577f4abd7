"""A user's model (``arch: custom``): the factory a spec names, its classifier head found by what it
does, and state dicts that load as they travel (plain tensors, no ``_metadata``).

* :func:`resolve_target`: the callable named by ``model.target`` (``"package.module:factory"``; the
  module must be importable by the processes that build the model: an installed package, or a
  folder on ``PYTHONPATH``).
* :func:`traced_head`: the head is the ``Conv2d`` / ``Linear`` producing the logits, the last one a
  forward pass calls (SqueezeNet's 1×1 convolution ``classifier.1`` as much as a ResNet's ``fc``),
  whatever its type or where the constructor registered it.
* :func:`versioned_loading`: ``load_state_dict`` of a state that travelled as plain tensors carries
  no ``_metadata`` (the per-module ``version`` ``state_dict()`` records); a module whose own
  ``_load_from_state_dict`` needs it (torchvision's MNASNet raises "version should be set to 1 or 2
  instead of None") is given its class's current ``_version``, which is what the sender, building
  the same class, recorded.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .rules import head_name

_ALLOWED = (
    "an importable 'package.module:factory' returning an nn.Module, e.g. torchvision.models:resnet18 "
    "(the module must be importable: an installed package, or its folder on PYTHONPATH, e.g. PYTHONPATH=.)"
)


def resolve_target(target: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:factory"`` (or ``"package.module.factory"``).

    Raises ``ValueError`` naming ``model.target`` when it cannot be imported or is not callable.
    """
    text = str(target)
    module_name, _, attr = text.partition(":") if ":" in text else text.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"invalid config: model.target={target!r}; allowed: {_ALLOWED}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"invalid config: model.target={target!r}; allowed: {_ALLOWED} ({err})") from None
    if not callable(obj):
        raise ValueError(f"invalid config: model.target={target!r} is not callable; allowed: {_ALLOWED}")
    return obj


class _LoadWithVersion:
    """A module's ``_load_from_state_dict`` that supplies the module's ``_version`` when the state's
    metadata has none (see the module docstring). An object, not a closure: it survives
    ``copy.deepcopy`` (bound to the copy) and pickling."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, state_dict: Any, prefix: str, local_metadata: dict[str, Any], *args: Any) -> Any:
        module = self.module
        if local_metadata.get("version") is None and getattr(module, "_version", None) is not None:
            local_metadata = {**local_metadata, "version": module._version}
        return type(module)._load_from_state_dict(module, state_dict, prefix, local_metadata, *args)


def _own_loader(module: nn.Module) -> bool:
    """Whether ``module``'s class loads state with a ``_load_from_state_dict`` of its own, outside torch
    (torch's own, e.g. BatchNorm's, read a missing version as "oldest" by design: left alone)."""
    for cls in type(module).__mro__:
        if "_load_from_state_dict" in cls.__dict__:
            return not cls.__module__.startswith("torch.")
    return False


def versioned_loading(model: nn.Module) -> nn.Module:
    """Every module of ``model`` with its own ``_load_from_state_dict`` (outside torch) gets its
    class's ``_version`` when a loaded state carries no metadata for it. Returns ``model``."""
    for module in model.modules():
        if _own_loader(module) and not isinstance(module.__dict__.get("_load_from_state_dict"), _LoadWithVersion):
            module._load_from_state_dict = _LoadWithVersion(module)  # type: ignore[method-assign,assignment]
    return model


def _called_layers(model: nn.Module, example: torch.Tensor) -> list[tuple[str, int]]:
    """(name, output channels) of every ``Conv2d`` / ``Linear`` a forward of ``example`` calls, in call
    order (eval mode, no gradients; the model's mode is restored)."""
    calls: list[tuple[str, int]] = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.dim() >= 1:
                calls.append((name, int(output.shape[1 if isinstance(module, nn.Conv2d) else -1])))

        return record

    handles = [
        m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return calls


#: :func:`traced_head` per spec (target, kwargs, input shape, classes): the architecture decides
_TRACED: dict[str, str | None] = {}


def traced_head(model: nn.Module, spec: Mapping[str, Any]) -> str | None:
    """The layer producing the logits of the user's model ``spec`` describes: the last ``Conv2d`` /
    ``Linear`` a forward of one input calls whose output has ``num_classes`` channels (else the last
    one called); traced once per spec and process. Without an image shape in the spec, or when the
    model cannot run one input, the static rule (:func:`fedhm_flwr.models.rules.head_name`) decides."""
    keys = ("target", "kwargs", "in_channels", "image_size", "num_classes")
    if not all(key in spec for key in keys[2:]):
        return head_name(model, spec.get("num_classes"))
    key = json.dumps({k: spec.get(k) for k in keys}, sort_keys=True, default=str)
    if key not in _TRACED:
        param = next(iter(model.parameters()), None)
        size, channels = int(spec["image_size"]), int(spec["in_channels"])
        try:
            with torch.random.fork_rng(devices=[]):
                example = torch.zeros(1, channels, size, size, device=param.device if param is not None else None)
                calls = _called_layers(model, example)
        except Exception:  # noqa: BLE001 - a model that cannot run one input: the static rule decides
            calls = []
        matching = [name for name, out in calls if out == int(spec["num_classes"])]
        _TRACED[key] = matching[-1] if matching else (calls[-1][0] if calls else None)
    traced = _TRACED[key]
    return traced if traced is not None else head_name(model, spec.get("num_classes"))


def build_custom(spec: Mapping[str, Any]) -> nn.Module:
    """A user's model: ``resolve_target(spec["target"])(**spec["kwargs"])``.

    Its classifier (per-class aggregation, left full by the default rule) is the model's
    ``classifier_name`` if it has one, else :func:`traced_head`. Its modules load states without
    metadata (:func:`versioned_loading`), as clients receive them.
    """
    model = resolve_target(spec["target"])(**dict(spec.get("kwargs") or {}))
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"invalid config: model.target={spec['target']!r} returned a {type(model).__name__}; "
            "allowed: a factory returning an nn.Module"
        )
    if getattr(model, "classifier_name", None) is None:
        head = traced_head(model, spec)
        if head is not None:
            model.classifier_name = head  # type: ignore[assignment]  # a plain attribute (torch types tensors, modules)
    return versioned_loading(model)
