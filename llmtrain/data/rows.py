"""The bad-row policy, written once: a row's fields are checked before anything downstream
(tokenizer, torch) sees them, and one function decides use / skip / raise."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from llmtrain.db.backend import Key
from llmtrain.db.keys import key_repr
from llmtrain.errors import BadRowError, ConfigError

log = logging.getLogger("llmtrain.data")
OnBadRow = Literal["raise", "skip"]
#: what a row's fields hold: text, or one conversation (an objective may check its own way)
Shape = Literal["text", "conversation"]
#: an objective's own check of a row: (field, problem) or None; it may normalise the row
RowCheck = Callable[[Mapping[str, Any], Sequence[str]], "tuple[str, str] | None"]


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


ROLES = ("system", "user", "assistant", "tool")


def conversation_problem(row: Mapping[str, object], field: str) -> str | None:
    """Why ``row[field]`` is not a conversation that can train, or None when it is."""
    messages = row.get(field)
    if isinstance(messages, str):  # a JSON column read as text: parsed in place
        try:
            messages = row[field] = json.loads(messages)  # type: ignore[index]
        except ValueError as exc:
            return f"is not a JSON list of messages ({exc})"
    if not isinstance(messages, list) or not messages:
        return f"is {type(messages).__name__}, not a list of messages"
    for turn, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {turn} is {type(message).__name__}, not a mapping"
        role = message.get("role")
        if role not in ROLES:
            return f"message {turn} has role {role!r}, not one of {list(ROLES)}"
        if role == "system" and turn:
            return f"message {turn} is a system message after the first"
        if role == "tool" and (not turn or messages[turn - 1]["role"] not in ("assistant", "tool")):
            return f"message {turn} is a tool result that follows no assistant call"
        problem = text_problem(message, "content")
        if problem is not None:
            return f"message {turn}'s content {problem}"
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant turn to train"
    return None


def check_row(
    source: str,
    key: Key,
    row: object,
    fields: Sequence[str],
    on_bad_row: OnBadRow = "raise",
    *,
    logged: set[str] | None = None,
    shape: Shape = "text",
    check: RowCheck | None = None,
) -> bool:
    """True: use the row; False: skip it (``on_bad_row="skip"``, see :func:`bad_row`); else raise
    BadRowError naming the source, key and first bad field (``check``: the objective's own)."""
    problem: tuple[str, str] | None
    if not isinstance(row, (dict, Mapping)):  # dict first: skips the ABC check
        problem = fields[0], f"cannot be read: the row is a {type(row).__name__}, not a mapping"
    elif check is not None:
        problem = check(row, fields)
    else:
        field_problem = conversation_problem if shape == "conversation" else text_problem
        found = ((field, field_problem(row, field)) for field in fields)
        problem = next(((field, p) for field, p in found if p is not None), None)
    return True if problem is None else bad_row(source, key, *problem, on_bad_row, logged)


def bad_row(
    source: str,
    key: Key,
    field: str,
    problem: str,
    on_bad_row: OnBadRow,
    logged: set[str] | None = None,
) -> bool:
    """Raise BadRowError, or log the skip once per ``logged`` set (a reader's: a run): False."""
    if on_bad_row == "raise":
        raise BadRowError(source, key, field, problem)
    if logged is None or key_repr(key) not in logged:
        log.warning("%s: skipping row %r: field %r %s", source, key, field, problem)
    if logged is not None:
        logged.add(key_repr(key))
    return False
