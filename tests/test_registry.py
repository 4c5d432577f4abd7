"""One registration per method: the classes named in ``server.registry.REGISTERED`` are the methods,
and every list of methods the project shows is derived from them and holds each one: the config's
table of options (what ``method=`` accepts), the strategies and their ``<Method>Strategy`` names, the
``strategies`` and ``clients`` faces, ``fedhm --help``, the Hydra group ``conf/method/`` and the
README's ``method=`` table. No method's class (or its options class) names a class derived from it."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import clients
import strategies
from fedhm_flwr.config import OPTIONS, ConfigError, compose_config, load_config
from fedhm_flwr.config.options import MethodOptions
from fedhm_flwr.ops import cli
from fedhm_flwr.server import registry
from fedhm_flwr.server.methods.method import Method

ROOT = Path(__file__).resolve().parents[1]
#: the registration: method.name -> the class named in REGISTERED (read from the classes, not from METHODS)
REGISTERED = {cls.name: cls for cls in registry.REGISTERED}


def test_each_method_is_registered_once_under_the_name_it_declares():
    assert len(REGISTERED) == len(registry.REGISTERED) >= 8  # no name twice
    assert registry.METHODS == REGISTERED
    for name, cls in REGISTERED.items():
        assert cls.options.name == name, cls  # the options class the method declares is its own


def test_every_registered_method_is_in_every_derived_list():
    names = set(REGISTERED)
    assert set(OPTIONS) == names  # what the config check accepts as method.name
    assert set(registry.STRATEGIES) == names
    for name, cls in REGISTERED.items():
        assert OPTIONS[name] is cls.options
        strategy = registry.STRATEGIES[name]
        assert strategy.method_class is cls and issubclass(strategy, registry.HeteroStrategy)
        alias = f"{cls.__name__}Strategy"
        assert getattr(registry, alias) is strategy and alias in registry.__all__
        for public in (cls.__name__, alias):
            assert public in strategies.__all__
        assert getattr(strategies, cls.__name__) is cls and getattr(strategies, alias) is strategy
    assert strategies.METHODS is registry.METHODS and strategies.STRATEGIES is registry.STRATEGIES
    assert set(clients.METHODS) == names
    with pytest.raises(AttributeError, match="NoSuchStrategy"):
        registry.NoSuchStrategy  # noqa: B018 - the derived names are the registered ones only


def test_from_imports_of_the_derived_names_work():
    """``from strategies import FjORDStrategy`` (what users' scripts write) for every method, in a fresh process."""
    methods = ", ".join(cls.__name__ for cls in REGISTERED.values())
    aliases = ", ".join(f"{cls.__name__}Strategy" for cls in REGISTERED.values())
    code = f"from strategies import {methods}, {aliases}\nfrom fedhm_flwr.server.registry import {aliases}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_fedhm_help_lists_every_method(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("Methods (method=<name>")]
    listed = line.split(":", 1)[1].replace(" ", "").split(",")
    assert sorted(listed) == sorted(REGISTERED)


def test_the_hydra_group_and_the_readme_table_name_every_method():
    """Each method has ``conf/method/<name>.yaml`` (``name: <name>``); every choice of the group runs a
    registered method, and the README's ``method=`` table has one row for each choice."""
    stems = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    group = {stem: compose_config(f"method={stem}").method.name for stem in stems}
    assert set(group.values()) == set(REGISTERED)
    assert all(group[name] == name for name in REGISTERED)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    header = readme.index("| `method=` |")
    rows = readme[header:].split("\n\n", 1)[0].splitlines()[2:]
    in_table = [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert sorted(in_table) == sorted(group), "README.md's method= table: one row per conf/method/ choice"


# --------------------------------------------------------------------------- no base names a subclass


def _classes(base: type) -> list[type]:
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _names_in_body(cls: type) -> set[str]:
    """The names a class's own code uses (identifiers and attributes, not its docstrings or comments)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def _derived_names(cls: type) -> set[str]:
    """The classes derived from ``cls`` (and, for a method, the options classes they declare that
    ``cls`` does not): what ``cls``'s code must not name."""
    out = set()
    for sub in _classes(cls)[1:]:
        out.add(sub.__name__)
        if issubclass(sub, Method) and sub.options is not getattr(cls, "options", None):
            out.add(sub.options.__name__)
    return out


@pytest.mark.parametrize("base", [Method, MethodOptions], ids=["methods", "options"])
def test_no_class_names_a_class_derived_from_it(base):
    project = [c for c in _classes(base) if c.__module__.startswith("fedhm_flwr.")]
    assert len(project) >= 8
    named = {c.__qualname__: sorted(_names_in_body(c) & _derived_names(c)) for c in project}
    assert {k: v for k, v in named.items() if v} == {}, "a class names its subclass: let the subclass declare it"


def test_the_check_sees_a_base_naming_its_subclass():
    class Parent(MethodOptions):
        def check(self) -> None:
            _ = Child  # the parent naming its child

    class Child(Parent):
        pass

    assert _names_in_body(Parent) & _derived_names(Parent) == {"Child"}


# --------------------------------------------------------------------------- the options table


def test_a_second_options_class_of_a_registered_name_is_refused():
    with pytest.raises(TypeError, match=r"'fjord'.*Impostor.*FjORDOptions"):

        class Impostor(MethodOptions):
            name = "fjord"

    assert OPTIONS["fjord"].__name__ == "FjORDOptions"


@pytest.mark.parametrize(
    "override",
    [
        "method=heterofl train.grad_clip=0.5",
        "method=fedrolex train.grad_clip=2",
        "method=fjord train.grad_clip=1",
        "method=fedavg method.family=heterofl train.grad_clip=0.5",
    ],
)
def test_a_train_clip_the_method_would_ignore_is_refused_naming_both_keys(override):
    """A method with ``method.grad_clip`` clips at it, in place of ``train.grad_clip``: a different
    ``train.grad_clip`` > 0 is refused rather than silently ignored."""
    with pytest.raises(ConfigError) as err:
        load_config(override)
    assert err.value.field == "train.grad_clip"
    assert "method.grad_clip" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "method=heterofl",  # the defaults: method.grad_clip=1.0, train.grad_clip=0
        "method=heterofl train.grad_clip=1.0",  # the same clip, said twice
        "method=heterofl method.grad_clip=0.5 train.grad_clip=0.5",
        "method=fedavg train.grad_clip=0.5",  # FedHM's family clips at train.grad_clip
        "method=fedhm train.grad_clip=0.5",
    ],
)
def test_a_clip_that_is_used_is_accepted(override):
    load_config(override)
