"""The project's own errors, apart from everything that raises them (bottom layer: no imports).

Each names what is wrong where a user can fix it: :class:`ConfigError` a config field and its
allowed values, :class:`DataSourceError` a folder source's field and what it should hold,
:class:`ShardError` a node's shard folder. All are ``ValueError``\\ s, so a caller that only knows
"bad input" catches them as such.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "DataSourceError", "ShardError"]


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"invalid config: {field}={value!r}; allowed: {allowed}")


class DataSourceError(ValueError):
    """A folder source's data is missing or malformed: names the config field, its value, what is wrong
    there and what is expected."""

    def __init__(self, field: str, value: Any, problem: str, expected: str) -> None:
        self.field, self.value, self.problem, self.expected = field, value, problem, expected
        super().__init__(f"{field}={value!r}: {problem}; expected {expected}")


class ShardError(ValueError):
    """A shard folder is missing, incomplete or corrupted; the message names the folder."""
