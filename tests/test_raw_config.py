"""The server (``fedhm_flwr/server/``) and the operations (``fedhm_flwr/ops/``, ``fedhm_flwr/api.py``)
read the run's parsed options (:class:`~fedhm_flwr.config.options.RunOptions`, built once with
``run_options(cfg)``), never fields of the raw config: checked on the source (AST, nothing imported).

A raw config is a name annotated ``DictConfig``, one assigned from a config loader (``load_config``,
``resume_config``, ``compose_config``, ``OmegaConf.load``/``merge``/``create``) or a name ``cfg``; a read
is an attribute or subscript of one (``cfg.rounds``, ``cfg.get(...)``, ``cfg["x"]``), an attribute of
a loader's result, or ``OmegaConf.select``/``to_container`` of one. Handing the config on (to
``run_options``, ``model_spec``, the data check), saving it (``to_yaml``) or setting a key
(``OmegaConf.update``) is not a read. An exception listed here must still occur, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUARDED = ("fedhm_flwr/server", "fedhm_flwr/ops", "fedhm_flwr/api.py")
LOADERS = {"load_config", "resume_config", "compose_config"}
OMEGACONF_LOADERS = {"load", "merge", "create"}
READERS = {"select", "to_container", "to_object"}

_HYDRA = "Hydra's own record of a sweep or its settings (multirun.yaml, the callback's config), not a run's config"
_HEALTH = (
    "the verdict on a finished run reads its saved config leniently (over today's base defaults, "
    "unvalidated): a config saved by older code that today's strict parser refuses still gets its verdict"
)
#: (file, first key read) -> why it still reads the raw config
EXCEPTIONS = {
    ("fedhm_flwr/ops/sweeps/multirun.py", "hydra"): _HYDRA,
    ("fedhm_flwr/ops/sweeps/sweep.py", "hydra"): _HYDRA,
    ("fedhm_flwr/ops/job/health.py", "dataset"): _HEALTH,
    ("fedhm_flwr/ops/job/health.py", "train"): _HEALTH,
    ("fedhm_flwr/ops/job/health.py", "failures"): _HEALTH,
}


def _is_loader(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return ast.unparse(func.value) == "OmegaConf" and func.attr in OMEGACONF_LOADERS
    return isinstance(func, ast.Name) and func.id in LOADERS


def _holders(tree: ast.AST) -> set[str]:
    """The names that hold a raw config in ``tree`` (see the module docstring)."""
    names = {"cfg"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
            if "DictConfig" in ast.unparse(node.annotation).split("|")[0]:
                target = node.arg if isinstance(node, ast.arg) else ast.unparse(node.target)
                names.add(target)
        elif isinstance(node, ast.Assign) and _is_loader(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def raw_reads(source: str) -> set[str]:
    """The first keys of the raw-config reads in ``source``."""
    tree = ast.parse(source)
    holders = _holders(tree)

    def held(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in holders) or _is_loader(node)

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and held(node.value):
            found.add(node.attr)
        elif isinstance(node, ast.Subscript) and held(node.value):
            key = node.slice
            found.add(str(key.value) if isinstance(key, ast.Constant) else ast.unparse(key))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in READERS
            and node.args
            and held(node.args[0])
        ):
            key = node.args[1] if len(node.args) > 1 else None
            found.add(str(key.value).split(".")[0] if isinstance(key, ast.Constant) else "*")
    return found


def _files() -> list[Path]:
    out: list[Path] = []
    for entry in GUARDED:
        path = ROOT / entry
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def test_the_server_and_the_operations_read_the_parsed_options_not_the_raw_config():
    found = {(str(f.relative_to(ROOT)), key) for f in _files() for key in raw_reads(f.read_text())}
    assert found - EXCEPTIONS.keys() == set(), "read RunOptions (run_options(cfg)) instead"
    assert EXCEPTIONS.keys() - found == set(), "an exception that no longer occurs: drop it from EXCEPTIONS"


def test_the_check_sees_every_kind_of_raw_read():
    source = """
from omegaconf import DictConfig, OmegaConf
def f(cfg, saved: DictConfig, opts):
    a = cfg.method.name
    b = saved["rounds"]
    c = OmegaConf.select(cfg, "train.lr")
    d = load_config(x).seed
    later = resume_config(run_dir)
    e = later.get("timeout")
    g = opts.rounds  # parsed options: not a read
    OmegaConf.update(cfg, "output_dir", "x")  # a write: not a read
    return to_yaml(cfg), run_options(cfg)  # handed on: not a read
"""
    assert raw_reads(source) == {"method", "rounds", "train", "seed", "get"}
