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
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
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
    """The merged graph and the modules and constants it calls.

    A node is shared when an earlier node runs the same operation on the same arguments: the same function or
    method, or a module (constant) equal to the earlier node's (:func:`_same_module`, :func:`_same_tensor`).
    Only the earlier nodes with the same arguments (and, for a module, of the same type; for a constant, of the
    same dtype, shape and device) are compared: a network's hundreds of modules are not each compared with
    every module held (a torchvision network's levels took seconds to merge that way)."""

    def __init__(self) -> None:
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.input = self.graph.placeholder("x")
        self.held = 0  # modules and constants registered on the root (m<i>, c<i>)
        #: (operation, what it calls or holds, arguments) -> the nodes so far, each with its module or constant
        self.nodes: dict[Hashable, list[tuple[Any, fx.Node]]] = {}

    def _node(self, key: Hashable, op: str, target: Any, args: Any, kwargs: Any, same: Any = None) -> fx.Node:
        """The node of ``key`` whose held object is ``same`` (None: any; a module or constant: an equal one),
        else a new one, ``target`` (a module or constant: registered on the root)."""
        candidates = self.nodes.setdefault(key, [])
        for kept, node in candidates:
            if same is None or kept is same or (_same_module if op == "call_module" else _same_tensor)(kept, same):
                return node
        name = target
        if op == "call_module":
            name = f"m{self.held}"
            module = copy.copy(same) if hasattr(same, "inplace") else same  # a shared value may feed several levels
            if module is not same:
                setattr(module, "inplace", False)  # noqa: B010 (an nn.Module attribute mypy types as Tensor | Module)
            self.root.add_module(name, module)
        elif op == "get_attr":
            name = f"c{self.held}"
            self.root.register_buffer(name, same.detach())
        self.held += op in ("call_module", "get_attr")
        node = self.graph.create_node(op, name, args, kwargs)
        candidates.append((same, node))
        return node

    def add(self, network: nn.Module, traced: Trace) -> Any:
        """``network``'s nodes (``traced``: its trace, or one of the same architecture) into the graph (the
        shared ones found); its output argument."""
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
            held: nn.Module | torch.Tensor | None = None
            what: Hashable = _frozen(target) if isinstance(target, str) else ("fn", id(target))
            if op == "call_module":
                held = network.get_submodule(str(target))
                what = ("module", type(held))
                k = _tile_pool(held)
                if k is not None and len(args) == 1 and not kwargs:
                    op, target, args, held, what = "call_function", max_pool_tiles, (args[0], k), None, ("pool", k)
            elif op == "get_attr":
                made = traced.made.get(str(target))
                tensor = made if made is not None else _attribute(network, str(target))
                held, what = tensor, ("tensor", tensor.dtype, tuple(tensor.shape), tensor.device)
            key = (op, what, _frozen(args), _frozen(kwargs))
            env[node] = self._node(key, op, target, args, kwargs, held)
        return out


def _attribute(module: nn.Module, path: str) -> torch.Tensor:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"get_attr {path} is not a tensor")
    return value


@dataclass(frozen=True)
class Trace:
    """A network's traced graph, holding no module of it (a graph copy without an owner): ``made``, the tensors the
    tracer made (``get_attr`` targets the network lacks); ``signature``, what each target was on the network."""

    graph: fx.Graph
    made: dict[str, torch.Tensor]
    signature: list[tuple[str, Hashable]]

    @classmethod
    def of(cls, network: nn.Module) -> Trace:
        traced = fx.symbolic_trace(network)
        graph = fx.Graph()
        graph.output(graph.graph_copy(traced.graph, {}))
        targets = [str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")]
        signature = [(t, _signature(network, t)) for t in targets]
        made = {t: _attribute(traced, t) for t, sig in signature if sig is None and _signature(traced, t) is not None}
        return cls(graph, made, signature)

    def fits(self, network: nn.Module) -> bool:
        return all(_signature(network, target) == sig for target, sig in self.signature)


class Traces:
    """The graphs of networks traced before, by a key that fixes a network's architecture (the model spec it
    was built from): a round's levels are rebuilt with new weights every round, their graphs are the same, and
    tracing a torchvision network's levels took about half a second a round. A graph is reused for a network
    whose modules and tensors at the graph's targets have the types (tensors: the dtypes and shapes) they had
    when it was traced; any other network is traced afresh. At most ``size`` graphs are kept, none holding the
    weights of the network it was traced from."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._traces: OrderedDict[Hashable, Trace] = OrderedDict()

    def trace(self, network: nn.Module, key: Hashable | None) -> Trace:
        """``network``'s trace, or that of an earlier network of the same key that fits it; raises when it cannot
        be traced."""
        kept = self._traces.get(key) if key is not None else None
        if kept is not None and kept.fits(network):
            self._traces.move_to_end(key)
            return kept
        trace = Trace.of(network)
        if key is not None and self.size > 0:
            self._traces[key] = trace
            while len(self._traces) > self.size:
                self._traces.popitem(last=False)
        return trace


def _signature(network: nn.Module, target: str) -> Hashable:
    """What a graph's target is on ``network``: a module's type, a tensor's dtype and shape (None: missing)."""
    value: Any = network
    for part in target.split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    return ("module", type(value)) if isinstance(value, nn.Module) else None


def merge_networks(
    networks: Sequence[nn.Module], keys: Sequence[Hashable | None] | None = None, traces: Traces | None = None
) -> nn.Module | None:
    """One module whose forward returns the tuple of every network's output on the same input, their
    equal prefix computed once; None when a network cannot be merged (see the module docstring). With
    ``traces``, a network whose key (``keys``) was traced before reuses its graph (:class:`Traces`)."""
    traces = traces if traces is not None else Traces(0)
    try:
        traced = [traces.trace(n, k) for n, k in zip(networks, keys or [None] * len(networks), strict=True)]
    except Exception:  # noqa: BLE001 (any tracing failure: the networks run one by one)
        return None
    for t in traced:
        if sum(n.op == "placeholder" for n in t.graph.nodes) != 1 or any(_writes_in_place(n) for n in t.graph.nodes):
            return None
    builder = _Builder()
    try:
        outputs = tuple(builder.add(n, t) for n, t in zip(networks, traced, strict=True))
    except (TypeError, AttributeError):
        return None
    builder.graph.output(outputs)
    merged = fx.GraphModule(builder.root, builder.graph)
    return merged.train(networks[0].training) if networks else merged


def distinct_operations(module: nn.Module) -> int:
    """How many operations a merged module's forward runs (its graph's nodes other than input and output)."""
    graph = module.graph if isinstance(module, fx.GraphModule) else fx.symbolic_trace(module).graph
    return sum(n.op not in ("placeholder", "output") for n in graph.nodes)
