"""Several networks run as one: the levels of a round evaluated in one pass, their common prefix computed
once (docs/METHODS.md, "Evaluation").

A level's deployable model often repeats the global model's first layers exactly: FedHM keeps the stem and
the first ``rho`` layers at full rank, so on the CNN at width 16 the global model's ``conv1``/``conv2``
blocks, about three quarters of its evaluation time on a CPU, are the same in every level. Running each
model on the test set repeats that work once per level. :func:`merge_networks` traces each network with
``torch.fx`` and builds one graph computing every network's output, where a node that every input of
which is shared and whose operation is the same (the same function, or a module of the same type with
equal attributes, parameters and buffers) is computed once. Each output is computed by the same
operations on the same values as the network alone, so it is equal bit for bit (tested).

A network ``torch.fx`` cannot trace (data-dependent control flow), or one that writes a tensor in place
other than through a module's ``inplace`` flag (``x += y``, ``relu_``), is not merged: the caller then
runs the networks one by one. Modules with an ``inplace`` flag run out of place in the merged graph
(the same values), since a shared value may feed several levels.

A non-overlapping ``nn.MaxPool2d(k)`` (stride ``k``, no padding, floor) runs in the merged graph as
:func:`max_pool_tiles`: elementwise maxima of the ``k × k`` strided views. A maximum is exact, so the values
are ``max_pool2d``'s (NaN propagates as there; of a tie between ``0.0`` and ``-0.0`` either may come out,
which no later sum, comparison or exponential tells apart); ``max_pool2d`` on a CPU also computes every
maximum's index, which evaluation never reads, and took about a third of a level evaluation's operations'
time on the default job's CNN (cProfile, one thread).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

#: ``call_function`` targets that write their first argument
_IN_PLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}


def _writes_in_place(node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_function":
        return node.target in _IN_PLACE_FUNCTIONS or getattr(node.target, "__name__", "").endswith("_")
    return node.op == "call_method" and str(node.target).endswith("_")


def max_pool_tiles(x: torch.Tensor, k: int) -> torch.Tensor:
    """``F.max_pool2d(x, k)`` (stride ``k``, no padding, floor) as maxima of strided views: the same values
    (see the module docstring), no indices. A tensor that is not a contiguous NCHW batch of at least one window
    goes to ``max_pool2d`` (which refuses one too small)."""
    if x.dim() != 4 or not x.is_contiguous() or not x.is_floating_point() or min(x.shape[-2:]) < k:
        return F.max_pool2d(x, k)
    h, w = x.shape[-2] // k * k, x.shape[-1] // k * k
    rows = x[..., 0:h:k, :w]
    for i in range(1, k):
        rows = torch.maximum(rows, x[..., i:h:k, :w])
    out = rows[..., 0::k]
    for j in range(1, k):
        out = torch.maximum(out, rows[..., j::k])
    return out.contiguous()


def _tile_pool(m: nn.Module) -> int | None:
    """``k`` of an ``nn.MaxPool2d(k)`` whose windows tile its input (stride ``k``, no padding, dilation 1,
    floor, no indices) and that has no hooks; None for any other module."""
    if type(m) is not nn.MaxPool2d or m.return_indices or m.ceil_mode or _hooked(m):
        return None
    k, s, p, d = (v if isinstance(v, tuple) else (v, v) for v in (m.kernel_size, m.stride, m.padding, m.dilation))
    return k[0] if k[0] == k[1] == s[0] == s[1] and p == (0, 0) and d == (1, 1) else None


def _same_module(a: nn.Module, b: nn.Module) -> bool:
    """The same computation: type, mode, public attributes, parameters and buffers (values and dtypes),
    and no hooks."""
    if type(a) is not type(b) or a.training != b.training or any(_hooked(m) for m in (a, b)):
        return False
    public = {k: v for k, v in vars(a).items() if not k.startswith("_")}
    if public != {k: v for k, v in vars(b).items() if not k.startswith("_")}:
        return False
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    return sa.keys() == sb.keys() and all(_same_tensor(sa[k], sb[k]) for k in sa)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _same_tensor(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


def _frozen(value: Any) -> Hashable:
    """A hashable stand-in for a node's arguments (nodes stay nodes: they are hashable)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in sorted(value.items())))
    if isinstance(value, slice):
        return ("slice", _frozen(value.start), _frozen(value.stop), _frozen(value.step))
    if isinstance(value, (fx.Node, int, float, str, bool, type(None), torch.dtype, torch.device)):
        return (type(value).__name__, value)
    return ("object", id(value))  # anything else: shared only if it is the same object


class _Builder:
    """The merged graph and the modules and constants it calls, each held once."""

    def __init__(self) -> None:
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.input = self.graph.placeholder("x")
        self.modules: list[nn.Module] = []
        self.constants: list[torch.Tensor] = []
        self.nodes: dict[Hashable, fx.Node] = {}

    def module(self, m: nn.Module) -> str:
        for i, held in enumerate(self.modules):
            if held is m or _same_module(held, m):
                return f"m{i}"
        self.modules.append(m)
        if hasattr(m, "inplace"):  # a shared value may feed several levels (same values out of place)
            m = copy.copy(m)
            setattr(m, "inplace", False)  # noqa: B010 (an nn.Module attribute mypy types as Tensor | Module)
        self.root.add_module(f"m{len(self.modules) - 1}", m)
        return f"m{len(self.modules) - 1}"

    def constant(self, t: torch.Tensor) -> str:
        for i, held in enumerate(self.constants):
            if held is t or _same_tensor(held, t):
                return f"c{i}"
        self.constants.append(t)
        self.root.register_buffer(f"c{len(self.constants) - 1}", t.detach())
        return f"c{len(self.constants) - 1}"

    def add(self, traced: fx.GraphModule) -> Any:
        """Network ``traced``'s nodes into the graph (the shared ones found); its output argument."""
        env: dict[fx.Node, fx.Node] = {}
        out: Any = None
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = self.input
                continue
            args = fx.map_arg(node.args, env.__getitem__)
            kwargs = fx.map_arg(node.kwargs, env.__getitem__)
            if node.op == "output":
                out = args[0]
                continue
            op, target = node.op, node.target
            k = _tile_pool(traced.get_submodule(str(target))) if op == "call_module" else None
            if k is not None and len(args) == 1 and not kwargs:
                op, target, args = "call_function", max_pool_tiles, (args[0], k)
            elif op == "call_module":
                target = self.module(traced.get_submodule(str(node.target)))
            elif node.op == "get_attr":
                target = self.constant(_attribute(traced, str(node.target)))
            key = (
                op,
                _frozen(target) if isinstance(target, str) else ("fn", id(target)),
                _frozen(args),
                _frozen(kwargs),
            )
            if key not in self.nodes:
                self.nodes[key] = self.graph.create_node(op, target, args, kwargs)
            env[node] = self.nodes[key]
        return out


def _attribute(module: nn.Module, path: str) -> torch.Tensor:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"get_attr {path} is not a tensor")
    return value


def merge_networks(networks: Sequence[nn.Module]) -> nn.Module | None:
    """One module whose forward returns the tuple of every network's output on the same input, their
    equal prefix computed once; None when a network cannot be merged (see the module docstring)."""
    try:
        traced = [fx.symbolic_trace(n) for n in networks]
    except Exception:  # noqa: BLE001 (any tracing failure: the networks run one by one)
        return None
    for t in traced:
        if sum(n.op == "placeholder" for n in t.graph.nodes) != 1 or any(_writes_in_place(n) for n in t.graph.nodes):
            return None
    builder = _Builder()
    try:
        outputs = tuple(builder.add(t) for t in traced)
    except TypeError:
        return None
    builder.graph.output(outputs)
    merged = fx.GraphModule(builder.root, builder.graph)
    return merged.train(networks[0].training) if networks else merged


def distinct_operations(module: nn.Module) -> int:
    """How many operations a merged module's forward runs (its graph's nodes other than input and output)."""
    graph = module.graph if isinstance(module, fx.GraphModule) else fx.symbolic_trace(module).graph
    return sum(n.op not in ("placeholder", "output") for n in graph.nodes)
