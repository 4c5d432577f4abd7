"""Each option is declared once (``fedhm_flwr/config/options/``: frozen pydantic dataclasses), the
YAML under ``conf/`` holds exactly the declared keys with the declared defaults, and no option is
checked by a string path (``num_in(cfg, "method.grad_clip", ...)``) in ``fedhm_flwr/config/``."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedhm_flwr.config import CONF_DIR, OPTIONS, ConfigError, load_config
from fedhm_flwr.config.options.declare import declared
from fedhm_flwr.config.options.groups import DATASET_GROUPS, MODEL_GROUPS, DatasetGroup, ModelGroup
from fedhm_flwr.config.options.run import RunOptions

ROOT = Path(__file__).resolve().parent.parent
#: RunOptions' fields that are not keys of conf/config.yaml's own: groups, and what is derived
NOT_IN_CONFIG_YAML = ("method", "model", "dataset", "data")


def _declaration(hint: object) -> type | None:
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg) and hasattr(arg, "__pydantic_fields__"):
            return arg
    return None


def _defaults(cls: type) -> dict[str, object]:
    """The declared defaults of ``cls`` as plain data (nested declarations as mappings, tuples as lists)."""
    out: dict[str, object] = {}
    for name, info in declared(cls).items():
        inner = _declaration(info.annotation)
        out[name] = _defaults(inner) if inner is not None else info.default
        if isinstance(out[name], tuple):
            out[name] = list(out[name])
    return out


def _plain(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def test_config_yaml_holds_the_declared_keys_with_the_declared_defaults():
    yaml = _plain(CONF_DIR / "config.yaml")
    for key in ("defaults", "hydra", "model"):  # Hydra's; the model group's shared keys (below)
        yaml.pop(key)
    declared_defaults = {k: v for k, v in _defaults(RunOptions).items() if k not in NOT_IN_CONFIG_YAML}
    assert yaml == declared_defaults


GROUPS = {"model": (MODEL_GROUPS, ModelGroup, "arch"), "dataset": (DATASET_GROUPS, DatasetGroup, "name")}


@pytest.mark.parametrize(
    "group, path",
    [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))],
    ids=lambda x: x,
)
def test_each_model_and_dataset_yaml_holds_its_declared_keys(group, path):
    """A group file (with conf/config.yaml's keys of the group) holds exactly its declaration's keys,
    each with the declared default but those the group sets for itself (``per_group``)."""
    kinds, base, key = GROUPS[group]
    values = {**_plain(CONF_DIR / "config.yaml").get(group, {}), **_plain(CONF_DIR / group / f"{path}.yaml")}
    kind = kinds.get(values[key], base)
    assert set(values) == set(declared(kind))
    defaults = _defaults(kind)
    assert {k: v for k, v in values.items() if k not in kind.per_group} == {
        k: v for k, v in defaults.items() if k not in kind.per_group
    }
    assert values[key] == path  # the group file is named by its architecture or dataset


def _method_groups():
    for path in sorted((CONF_DIR / "method").glob("*.yaml")):
        group = _plain(path)
        group.pop("defaults", None)
        yield path.stem, group.get("method", group)  # a group placing itself at the top level


@pytest.mark.parametrize("stem, group", list(_method_groups()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_method_yaml_holds_its_declared_keys_with_the_declared_defaults(stem, group):
    options = OPTIONS[group.pop("name")]
    assert group == {**_defaults(options), **options.presets.get(stem, {})}
    assert stem == options.name or stem in options.presets  # a preset is named by its class


def _declarations() -> dict[str, type]:
    """Every declaration, by the dotted path of the section it declares (a method's: method[name])."""
    found: dict[str, type] = {}

    def walk(cls: type, path: str) -> None:
        found[path] = cls
        for name, info in declared(cls).items():
            inner = _declaration(info.annotation)
            if inner is not None and name not in NOT_IN_CONFIG_YAML:
                walk(inner, f"{path}.{name}".lstrip("."))

    walk(RunOptions, "")
    for kinds, base, _ in GROUPS.values():
        for cls in {base, *kinds.values()}:
            walk(cls, f"{base.__name__}[{cls.__name__}]")
    for options in OPTIONS.values():
        for cls in options.__mro__:
            if "__pydantic_fields__" in vars(cls):
                walk(cls, f"method[{cls.__name__}]")
    return found


def redeclared(classes) -> dict[str, set[str]]:
    """The fields a declaration of ``classes`` declares again that a declaration it derives from
    already declares (by class name)."""
    out = {}
    for cls in classes:
        own = set(vars(cls).get("__annotations__", {})) & set(declared(cls))
        inherited = {n for base in cls.__mro__[1:] if "__pydantic_fields__" in vars(base) for n in declared(base)}
        if own & inherited:
            out[cls.__name__] = own & inherited
    return out


def test_every_option_key_is_declared_in_exactly_one_declaration():
    """A key is a field of one class's own body, in one section: a subclass (a method of a family, a
    kind of model or data source) inherits its base's fields and does not declare them again; the
    shared sections are declared once each (one class per section path)."""
    found = _declarations()
    assert redeclared(found.values()) == {}
    sections = [p for p in found if "[" not in p]
    assert len({found[p] for p in sections}) == len(sections)  # no class serves two section paths


def test_the_check_finds_a_planted_second_declaration():
    from pydantic.dataclasses import dataclass

    from fedhm_flwr.config.options.declare import DECLARED, Num, option
    from fedhm_flwr.config.options.width import WidthOptions

    @dataclass(frozen=True, config=DECLARED)
    class Planted(WidthOptions):
        grad_clip: Num = option(2.0, "declared again")

    assert redeclared([Planted]) == {"Planted": {"grad_clip"}}
    assert redeclared([WidthOptions]) == {}


def test_every_declared_option_says_what_it_means():
    for cls in _declarations().values():
        for name, info in declared(cls).items():
            if name not in NOT_IN_CONFIG_YAML:
                assert info.description, f"{cls.__name__}.{name}"


#: the string-path checks of the raw config (``helper(cfg, "a.b", ...)``)
PATH_CHECKS = {"num_in", "int_at_least", "flags", "choice", "require"}
#: (file, first dotted path) -> why it still checks by path; it must still occur, so the list only shrinks
REMAINING: dict[tuple[str, str], str] = {}


def path_checks(source: str) -> set[str]:
    """The dotted paths that ``source`` checks with a string-path helper (its first string argument)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PATH_CHECKS:
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                    break
    return found


def test_the_scan_finds_a_planted_string_path_check():
    assert path_checks('def f(cfg):\n    num_in(cfg, "method.grad_clip", 0.0, 1.0)\n') == {"method.grad_clip"}
    assert path_checks('require(ok, "train.lr", v, "a number")') == {"train.lr"}
    assert path_checks('option(1.0, "a meaning")') == set()


def test_no_option_is_checked_by_a_string_path_in_config():
    found = set()
    for path in sorted((ROOT / "fedhm_flwr" / "config").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found |= {(rel, key) for key in path_checks(path.read_text())}
    assert found - set(REMAINING) == set()
    assert set(REMAINING) - found == set(), "a remaining exception no longer occurs: drop it from REMAINING"
    assert not any((ROOT / "fedhm_flwr" / "config").rglob("checks.py"))  # the helpers' module is gone


def test_a_declared_option_is_refused_with_its_declared_range():
    with pytest.raises(ConfigError, match=r"invalid config: method\.grad_clip=-1; allowed: a number in \[0\.0, inf\)"):
        load_config("method=heterofl method.grad_clip=-1")
    with pytest.raises(ConfigError, match=r"train\.masked_ce='maybe'; allowed: true or false"):
        load_config("train.masked_ce=maybe")
    with pytest.raises(ConfigError, match=r"wire\.dtype='float8'; allowed: one of \['float32', 'float16', 'bf"):
        load_config("wire.dtype=float8")
    with pytest.raises(ConfigError, match=r"train\.batch_size=True; allowed: an integer >= 1"):
        load_config("train.batch_size=true")
