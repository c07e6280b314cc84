"""Checking the fields of a row before anything downstream (tokenizer, torch) sees them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from llmtrain.backends.base import Key, Row
from llmtrain.errors import BadRowError, ConfigError

OnBadRow = Literal["raise", "skip"]


def check_on_bad_row(value: str) -> OnBadRow:
    if value not in ("raise", "skip"):
        raise ConfigError(f"on_bad_row must be 'raise' or 'skip', got {value!r}")
    return value  # type: ignore[return-value]


def normalise_fields(fields: str | Sequence[str]) -> tuple[str, ...]:
    names = (fields,) if isinstance(fields, str) else tuple(fields)
    if not names or not all(isinstance(f, str) and f for f in names):
        raise ConfigError(f"fields must be one or more non-empty names, got {fields!r}")
    if len(set(names)) != len(names):
        raise ConfigError(f"fields {list(names)} name a field twice")
    return names


def text_problem(row: Row, field: str) -> str | None:
    """Why ``row[field]`` is not usable text, or None when it is."""
    if field not in row:
        return "is missing"
    value = row[field]
    if value is None:
        return "is null"
    if not isinstance(value, str):
        return f"is {type(value).__name__}, not a string"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"is not valid UTF-8 text ({exc.reason} at position {exc.start})"
    return None


def check_row(source: str, key: Key, row: Row, fields: Sequence[str]) -> None:
    """Raise BadRowError naming the source, the row key and the first bad field."""
    for field in fields:
        problem = text_problem(row, field)
        if problem is not None:
            raise BadRowError(source, key, field, problem)
