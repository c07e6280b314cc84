"""The bad-row policy, written once: a row's fields are checked before anything downstream
(tokenizer, torch) sees them, and one function decides use / skip / raise."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Literal

from llmtrain.db.backend import Key
from llmtrain.db.keys import key_repr
from llmtrain.errors import BadRowError, ConfigError

log = logging.getLogger("llmtrain.data")
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


def text_problem(row: Mapping[str, object], field: str) -> str | None:
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


def check_row(
    source: str,
    key: Key,
    row: object,
    fields: Sequence[str],
    on_bad_row: OnBadRow = "raise",
    *,
    logged: set[str] | None = None,
) -> bool:
    """True: use the row. False: skip it (``on_bad_row="skip"``). Otherwise raise
    BadRowError naming the source, the row's key and its first bad field.

    A skipped row is logged once per ``logged`` set (a reader keeps one per run, so a row is
    not logged again every epoch); only bad rows pay for that bookkeeping."""
    readable = isinstance(row, (dict, Mapping))  # dict first: skips the ABC check
    for field in fields:
        problem = (
            text_problem(row, field)  # type: ignore[arg-type]
            if readable
            else f"cannot be read: the row is a {type(row).__name__}, not a mapping"
        )
        if problem is None:
            continue
        if on_bad_row == "raise":
            raise BadRowError(source, key, field, problem)
        if logged is not None:
            name = key_repr(key)
            if name in logged:
                return False
            logged.add(name)
        log.warning("%s: skipping row %r: field %r %s", source, key, field, problem)
        return False
    return True
