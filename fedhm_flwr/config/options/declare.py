"""How an option is declared, once: a field of a frozen pydantic dataclass (``extra="forbid"``) with
its type, default, allowed range or values and one line of meaning (:func:`option`), and how a
config section is parsed against it (:func:`parse`): pydantic's errors become the project's one-line
:class:`~fedhm_flwr.core.errors.ConfigError` naming the key's dotted path, the value and what is
allowed (said by the declaration: :func:`allowed`).

Pydantic dataclasses rather than ``BaseModel``: the options stay dataclasses to their readers
(``dataclasses.replace``, ``asdict``, ``FrozenInstanceError``), and the types are checked strictly
as the config check always did (no bool for a number, no float for an integer, no string for
anything else; an integer is taken for a float and becomes one, a list for a tuple).
Torch-free and Flower-free: the launcher checks a config with it before importing torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, cast

import annotated_types as at
from pydantic import BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler, Strict, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

from fedhm_flwr.core.errors import ConfigError

__all__ = [
    "DECLARED",
    "Flag",
    "InfNum",
    "Int",
    "Num",
    "OneOf",
    "Refused",
    "Text",
    "allowed",
    "declared",
    "option",
    "parse",
    "yaml_number",
]

T = TypeVar("T")

#: the config of every declaration: frozen, unknown keys refused
DECLARED = ConfigDict(extra="forbid")  # frozen: by the decorator, @dataclass(frozen=True, config=DECLARED)

Flag = Annotated[bool, Strict()]
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict()]
Text = Annotated[str, Strict()]


def yaml_number(value: Any) -> Any:
    """YAML's ``.inf`` (a string to Hydra's override grammar) as infinity; any other value as it is."""
    if isinstance(value, str) and value.strip().lower() in (".inf", "+.inf"):
        return math.inf
    return value


#: a float that also takes YAML's ``.inf`` written as a string
InfNum = Annotated[float, BeforeValidator(yaml_number), Strict()]


@dataclasses.dataclass(frozen=True)
class OneOf:
    """A choice among ``values`` (``Annotated[str, Strict(), OneOf(values)]``: the option's type stays
    ``str``, its values those of a tuple the code also reads)."""

    values: tuple[Any, ...]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: Any) -> Any:
        if value not in self.values:
            raise ValueError(f"not one of {list(self.values)}")
        return value


def option(
    default: Any,
    meaning: str,
    *,
    allowed: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """One option's declaration: its ``default`` (immutable: a tuple for a list), one line of
    ``meaning``, the numeric bounds and, where the type and bounds do not say it plainly, the text
    of what is ``allowed`` (the error message's)."""
    extra: dict[str, Any] = {"allowed": allowed} if allowed else {}
    return Field(default, description=meaning, json_schema_extra=extra, ge=ge, gt=gt, le=le, lt=lt)


class Refused(ValueError):
    """Raised by a declaration's validator: its own field ``field`` holds a value that is not
    ``allowed`` (None: what the field's declaration allows); :func:`parse` names the full path."""

    def __init__(self, field: str, allowed: str | None = None) -> None:
        self.field, self.allowed = field, allowed
        super().__init__(f"{field}: {allowed}")


def declared(cls: type) -> dict[str, FieldInfo]:
    """The options a declaration holds (inherited ones too), by name."""
    return dict(cls.__pydantic_fields__)  # type: ignore[attr-defined]


def _bounds(info: FieldInfo) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in info.metadata:
        for kind in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(at, kind.capitalize())):
                out[kind] = getattr(m, kind)
    return out


def allowed(info: FieldInfo) -> str:
    """What a declared option allows, as the error message says it."""
    extra = info.json_schema_extra
    if isinstance(extra, dict) and extra.get("allowed"):
        return str(extra["allowed"])
    hint = info.annotation
    while typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    choices = [m for m in info.metadata if isinstance(m, OneOf)]
    if choices:
        return f"one of {list(choices[0].values)}"
    if typing.get_origin(hint) is Literal:
        return f"one of {list(typing.get_args(hint))}"
    if hint is bool:
        return "true or false"
    b = _bounds(info)
    if hint is int:
        return f"an integer >= {b['ge']}" if "ge" in b else "an integer"
    if hint is float:
        low, lo = (float(b["gt"]), "(") if "gt" in b else (float(b.get("ge", -math.inf)), "[")
        high, hi = (float(b["lt"]), ")") if "lt" in b else (float(b.get("le", math.inf)), "]")
        return f"a number in {lo}{low}, {high}{hi}"
    return f"a value of type {getattr(hint, '__name__', hint)}"


def _is_declaration(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint) and hasattr(hint, "__pydantic_fields__")


def _inner(hint: Any) -> Any:
    """The declaration class inside ``hint`` (``X | None``), else ``hint``."""
    for arg in typing.get_args(hint) or ():
        if _is_declaration(arg):
            return arg
    return hint


def _locate(cls: type, loc: tuple[int | str, ...]) -> tuple[list[str], FieldInfo | None, Any]:
    """The field names along ``loc`` through nested declarations, the last one's declaration, and the
    declaration a further step of ``loc`` would be a key of."""
    names: list[str] = []
    info: FieldInfo | None = None
    holder: Any = cls
    for step in loc:
        fields = declared(holder)
        if not (isinstance(step, str) and step in fields):
            break
        names.append(step)
        info = fields[step]
        inner = _inner(info.annotation)
        if not _is_declaration(inner):
            break
        holder = inner
    return names, info, holder


def _value(values: Any, names: list[str]) -> Any:
    for name in names:
        values = values.get(name) if isinstance(values, Mapping) else getattr(values, name, None)
    return values


def parse(cls: type[T], values: Any, section: str, context: Mapping[str, Any] | None = None) -> T:
    """The declaration ``cls`` of the config section ``values`` (``section``: its dotted path, ""
    for the top level; ``context``: the whole config, for the rules across sections). The first
    problem raises :class:`ConfigError`: an unknown key (with the keys allowed), a value of the
    wrong type or out of its range (with what the option allows), or a rule a validator refused."""
    where = f"{section}." if section else ""
    if not isinstance(values, Mapping):
        raise ConfigError(section, values, f"a mapping of the keys {list(declared(cls))}")
    try:
        validator = cls.__pydantic_validator__  # type: ignore[attr-defined]
        return cast(T, validator.validate_python(dict(values), context=dict(context or {})))
    except ValidationError as err:
        raise _config_error(cls, values, where, err) from None


def _config_error(cls: type, values: Any, where: str, err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a rule across sections names its keys itself
        return cause
    names, info, holder = _locate(cls, loc)
    if isinstance(cause, Refused):  # a model validator's rule on a field of its own
        field = [*names, cause.field]
        text = cause.allowed or allowed(declared(holder)[cause.field])
        return ConfigError(where + ".".join(field), _value(values, field), text)
    path = where + ".".join(names)
    if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = path.rstrip(".")
        key = str(loc[len(names)])
        return ConfigError(
            f"{parent}.{key}" if parent else key,
            first["input"],
            f"a key of {parent or 'the config'}: one of {list(declared(holder))}",
        )
    assert info is not None, first
    if first["type"] == "dataclass_type":  # a section that is not a mapping
        return ConfigError(path, _value(values, names), f"a mapping of the keys {list(declared(holder))}")
    return ConfigError(path, _value(values, names), allowed(info))
