"""The docs tell the truth about the code: the code's citations of docs/METHODS.md point at anchors that
exist there, and docs/ARCHITECTURE.md's layer table and the modules, names and files the
architecture pages name exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"docs/METHODS\.md((?:#[a-z0-9-]+)(?:, #[a-z0-9-]+)*)")


def test_every_cited_methods_anchor_exists():
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', (ROOT / "docs" / "METHODS.md").read_text()))
    cited: dict[str, set[str]] = {}
    for folder in ("fedhm_flwr", "strategies", "clients", "conf", "tests", "bench", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".md") and path.is_file():
                for group in CITED.findall(path.read_text(encoding="utf-8")):
                    for anchor in re.findall(r"#([a-z0-9-]+)", group):
                        cited.setdefault(anchor, set()).add(str(path.relative_to(ROOT)))
    assert len(cited) >= 10  # the method modules and configs cite it
    missing = {a: sorted(p) for a, p in cited.items() if a not in anchors}
    assert not missing, f"anchors cited but absent from docs/METHODS.md: {missing}"


# --------------------------------------------------------------------------- the architecture pages

PACKAGE = ROOT / "fedhm_flwr"
#: pages whose code references must resolve: the layers and the way through adding a method
CODE_PAGES = ("docs/ARCHITECTURE.md", "docs/ADDING_A_METHOD.md")
#: a folder cell's group: `folder/` (`module`, `module`, ...)
GROUP = re.compile(r"`([\w/]+/)` \(((?:`[\w]+`(?:, )?)+)\)")
#: a backticked dotted name in the package (``ops.apps.server_app.main``, ``server.registry.STRATEGIES[m]``)
DOTTED = re.compile(
    r"`((?:fedhm_flwr\.)?(?:core|math|models|data|config|reporting|server|client|ops)(?:\.\w+)+)(?:\[[^]`]*\])?`"
)
#: a backticked file of the repository (``fedhm_flwr/server/methods/fjord.py``, ``conf/method/fjord.yaml``)
FILE = re.compile(
    r"`((?:fedhm_flwr|tests|conf|docs|bench|scripts|strategies|clients)/[\w/.-]+\.(?:py|yaml|md))(?:#[\w-]+)?`"
)


def rooms_table(text: str | None = None) -> dict[str, set[str]]:
    """The folders of docs/ARCHITECTURE.md's layer table (relative to the package; ``""``: the package
    itself) -> the modules named for each."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text() if text is None else text
    rows = [line.split("|")[2] for line in text.splitlines() if line.startswith("| ") and line.count("|") >= 5]
    out: dict[str, set[str]] = {}
    for cell in rows:
        for folder, names in GROUP.findall(cell):
            key = "" if folder == "fedhm_flwr/" else folder.rstrip("/")
            out.setdefault(key, set()).update(re.findall(r"`(\w+)`", names))
    return out


def folder_modules(folder: str) -> set[str]:
    """The modules of one folder of the package (its ``__init__`` aside), as the table names them."""
    return {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}


def table_mismatches(table: dict[str, set[str]]) -> dict[str, tuple[list[str], list[str]]]:
    """Per folder of the table whose list is wrong: (its modules the table leaves out, names listed
    that are none of its modules)."""
    wrong = {f: (sorted(folder_modules(f) - names), sorted(names - folder_modules(f))) for f, names in table.items()}
    return {f: d for f, d in wrong.items() if d != ([], [])}


def test_the_layer_table_names_every_module_and_nothing_else():
    table = rooms_table()
    assert {"core", "server", "server/methods", "ops", "ops/apps"} <= set(table), sorted(table)
    assert table_mismatches(table) == {}, "(unlisted, listed but absent) per folder"
    packages = {str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")} - {"."}
    assert sorted(packages - set(table)) == [], "a folder of the package the table does not list"


def _defined(path: Path) -> dict[str, set[str]]:
    """Top-level names a module defines or imports -> the names defined in that name's class body."""
    tree = ast.parse(path.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body if isinstance(node, ast.ClassDef) else []
            out[node.name] = {getattr(n, "name", "") for n in body} | {
                t.id for n in body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in _targets(n)
            }
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            out.update((t.id, set()) for t in _targets(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(((a.asname or a.name).split(".")[0], set()) for a in node.names)
    return out


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.Name]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [t for t in flat if isinstance(t, ast.Name)]


def resolves(dotted: str) -> bool:
    """``core.protocol``, ``ops.apps.server_app.main``, ``server.strategy.HeteroStrategy.configure_train``:
    a module of the package, or a name (at most a class and its member) defined in one."""
    parts = dotted.removeprefix("fedhm_flwr.").split(".")
    for cut in range(len(parts), 0, -1):
        base = PACKAGE.joinpath(*parts[:cut])
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if path.is_file():
            rest = parts[cut:]
            if not rest:
                return True
            names = _defined(path)
            return len(rest) <= 2 and rest[0] in names and (len(rest) == 1 or rest[1] in names[rest[0]])
    return False


def code_references(text: str) -> tuple[list[str], list[str]]:
    """(backticked dotted names of the package, backticked repository files) in a page."""
    return DOTTED.findall(text), FILE.findall(text)


@pytest.mark.parametrize("page", CODE_PAGES)
def test_the_code_a_page_names_exists(page):
    """Every module, name and file the page names in backticks exists (a renamed module leaves none
    behind)."""
    dotted, files = code_references((ROOT / page).read_text())
    assert len(dotted) + len(files) >= 10, "the page names the code it describes"
    assert sorted(d for d in dotted if not resolves(d)) == []
    assert sorted(f for f in files if not (ROOT / f).is_file()) == []


def test_the_reference_checks_see_a_stale_name():
    """A module moved away, a name it no longer defines and a file that is gone are all refused."""
    dotted, files = code_references("`ops.server_app.main`, `server.registry.NO_SUCH`, `tests/nope.py`")
    assert dotted == ["ops.server_app.main", "server.registry.NO_SUCH"] and files == ["tests/nope.py"]
    assert not resolves(dotted[0]) and not resolves(dotted[1]) and resolves("ops.apps.server_app.main")
    assert resolves("server.strategy.HeteroStrategy.configure_train")
    assert not resolves("server.strategy.HeteroStrategy.no_such_method")
    assert not (ROOT / files[0]).is_file()
    stale = rooms_table("| operations | `ops/tools/` (`inspect`, `export`) | everything below | tools |")
    assert table_mismatches(stale)["ops/tools"] == (["cost_table", "model_card", "onnx_model", "pretrain"], ["inspect"])


def test_the_light_imports_the_architecture_page_names_are_light():
    """docs/ARCHITECTURE.md: ``import fedhm_flwr.data.catalog`` loads no numpy and no torch, and
    ``import fedhm_flwr.data.files`` (the launcher's data check) no torch."""
    code = (
        "import sys\nimport fedhm_flwr.data.catalog\n"
        "assert not {'numpy', 'torch'} & set(sys.modules), 'data.catalog loaded numpy or torch'\n"
        "import fedhm_flwr.data.files\nassert 'torch' not in sys.modules, 'data.files loaded torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
