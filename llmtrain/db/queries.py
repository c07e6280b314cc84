"""Row selections as plain data (``to_dict``/``from_dict``), fingerprinted alike by any process."""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from bson import json_util

from llmtrain.errors import QueryError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
_JS_OPERATORS = frozenset({"$where", "$function", "$accumulator"})
_Q = TypeVar("_Q", bound="Query")
_CANONICAL = json_util.CANONICAL_JSON_OPTIONS


def _check_name(kind: str, name: object) -> str:
    """Names reach SQL only through SQLAlchemy's quoting; still refuse what no sane schema has."""
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 128:
        raise QueryError(f"{kind} name {name!r} is not a valid identifier")
    return name


class Query(ABC):
    """Base of every query: serialisation, fingerprint and loading by ``kind``."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def source(self) -> str:
        """A human-readable name of where rows come from, used in error messages."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def _from_fields(cls: type[_Q], data: dict[str, Any]) -> _Q:
        """The query that ``to_dict()`` gave ``data``: its fields are the constructor's."""
        return cls(**{k: v for k, v in data.items() if k != "kind"})

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Query:
        if not isinstance(data, dict) or "kind" not in data:
            raise QueryError(f"not a stored query: {data!r}")
        if (cls := _KINDS.get(data["kind"])) is None:
            raise QueryError(f"unknown query kind {data['kind']!r}")
        try:
            return cls._from_fields(data)
        except TypeError as exc:  # a field missing or unknown: say which, as a QueryError
            raise QueryError(f"not a stored {data['kind']} query: {exc}") from None

    def fingerprint(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Query) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"

    def fields(self, X: str, Y: str | None = None) -> Part:  # noqa: N803 - fit()'s names
        """Its own X (and Y) inside :func:`mix`: no Y trains documents, a Y prompt and response."""
        return Part(self, _check_name("X field", X), None if Y is None else _check_name("Y", Y))


class Table(Query):
    """Rows of one SQL table, keyed by its primary key unless ``key=``:
    ``Table("docs").where("lang = :lang", lang="en").select("instruction", "output")``."""

    kind = "sql_table"

    def __init__(
        self,
        name: str,
        *,
        schema: str | None = None,
        key: str | None = None,
        where: str | None = None,
        params: dict[str, Any] | None = None,
        columns: tuple[str, ...] | list[str] | None = None,
    ) -> None:
        self.name = _check_name("table", name)
        self.schema = _check_name("schema", schema) if schema is not None else None
        self.key = _check_name("key column", key) if key is not None else None
        self.where_sql = where
        self.params = dict(params or {})
        self.columns = tuple(_check_name("column", c) for c in columns) if columns else None
        _check_params(self.params)

    def where(self, condition: str, **params: Any) -> Table:
        """Add a WHERE fragment with ``:name`` placeholders; values are always bound."""
        if not isinstance(condition, str) or not condition.strip():
            raise QueryError("where() needs a non-empty SQL condition")
        if ";" in condition:
            raise QueryError(
                f"where({condition!r}): one condition, without ';' (bind values as :params)"
            )
        merged = f"({self.where_sql}) AND ({condition})" if self.where_sql else condition
        if clash := set(params) & set(self.params):
            raise QueryError(f"where() parameter(s) {sorted(clash)} are already bound")
        return self._from_fields(
            {**self.to_dict(), "where": merged, "params": {**self.params, **params}}
        )

    def select(self, *columns: str) -> Table:
        return self._from_fields({**self.to_dict(), "columns": columns})

    @property
    def source(self) -> str:
        return f"table {self.schema + '.' if self.schema else ''}{self.name}"

    def to_dict(self) -> dict[str, Any]:
        names = {"name": self.name, "schema": self.schema, "key": self.key, "where": self.where_sql}
        columns = list(self.columns) if self.columns else None
        return {"kind": self.kind, **names, "params": self.params, "columns": columns}


class RawSQL(Query):
    """Any SELECT (joins, views); ``key`` names a unique, orderable output column."""

    kind = "sql_raw"

    def __init__(
        self,
        text: str,
        *,
        key: str,
        params: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> None:
        if not isinstance(text, str) or not text.strip():
            raise QueryError("sql() needs a SELECT statement")
        if ";" in text.strip().rstrip(";"):
            raise QueryError("sql() takes a single SELECT statement, without ';' inside it")
        if not key:
            raise QueryError("sql() needs key=: a unique column of the result to page on")
        self.text = text.strip().rstrip(";")
        self.key = _check_name("key column", key)
        self.params = dict(params or {})
        self.table = source  # the table the key column comes from (None: parsed from text)
        _check_params(self.params)

    @property
    def source(self) -> str:
        return "sql query " + (self.text[:60] + "..." if len(self.text) > 60 else self.text)

    def to_dict(self) -> dict[str, Any]:
        data = {"kind": self.kind, "text": self.text, "key": self.key, "params": self.params}
        return data if self.table is None else {**data, "source": self.table}


def sql(text: str, *, key: str, source: str | None = None, **params: Any) -> RawSQL:
    """A raw SELECT with bound ``:name`` parameters, paged on the unique column ``key``;
    ``source``: the table that column comes from, when parsing cannot tell."""
    return RawSQL(text, key=key, params=params, source=source)


def sql_reward(text: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """A reward the database computes for each generated answer: one SELECT of one number with
    ``:completion``, ``:prompt``, ``:key`` and the row's fields as parameters, run read-only;
    NULL, an error or ``timeout_s`` passed: a bad reward (recorded), not a crash."""
    if not isinstance(text, str) or not text.strip():
        raise QueryError("sql_reward() needs a SELECT statement")
    if not 0 < timeout_s <= 3600:
        raise QueryError(f"sql_reward(timeout_s=) must be in (0, 3600], got {timeout_s!r}")
    return {"sql": text.strip().rstrip(";"), "timeout_s": float(timeout_s)}


class Collection(Query):
    """Documents of one MongoDB collection: ``Collection("docs").find({"lang": "en"})``."""

    kind = "mongo_find"

    def __init__(
        self,
        name: str,
        *,
        filter: dict[str, Any] | None = None,  # noqa: A002 - MongoDB's own word
        projection: dict[str, Any] | list[str] | None = None,
        allow_javascript: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name or "$" in name or "\x00" in name:
            raise QueryError(f"collection name {name!r} is not valid")
        self.name = name
        self.filter = dict(filter or {})
        if isinstance(projection, (list, tuple)):
            projection = {p: 1 for p in projection}
        self.projection = dict(projection) if projection else None
        self.allow_javascript = allow_javascript
        if not allow_javascript:
            _refuse_javascript(self.filter, "filter")

    def find(
        self,
        filter: dict[str, Any] | None = None,  # noqa: A002
        projection: dict[str, Any] | list[str] | None = None,
        *,
        allow_javascript: bool = False,
    ) -> Collection:
        return Collection(
            self.name, filter=filter, projection=projection, allow_javascript=allow_javascript
        )

    @property
    def source(self) -> str:
        return f"collection {self.name}"

    def to_dict(self) -> dict[str, Any]:
        filt = json.loads(json_util.dumps(self.filter, json_options=_CANONICAL))
        flags = {"projection": self.projection, "allow_javascript": self.allow_javascript}
        return {"kind": self.kind, "name": self.name, "filter": filt, **flags}

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> Collection:
        filt = json_util.loads(json.dumps(data.get("filter") or {}), json_options=_CANONICAL)
        allow = bool(data.get("allow_javascript", False))
        return super()._from_fields({**data, "filter": filt, "allow_javascript": allow})


MESSAGES, TURNS = "messages", "llmtrain_turns"  # a conversation's fields; turns: its version


class Conversations(Query):
    """Message rows as conversations, one row ``{"messages": [{"role", "content"}, ...]}`` a ``by``
    key, in ``order``; the snapshot records the last turn, so later turns wait for the next run."""

    kind = "conversations"

    def __init__(
        self, messages: Query, *, by: str, order: str, role: str = "role", content: str = "content"
    ) -> None:
        if isinstance(messages, Table):
            # the group key is the key its rows are named by (forget, lineage)
            messages = Table._from_fields({**messages.to_dict(), "key": by})
        elif not isinstance(messages, Collection):
            raise QueryError(
                "Conversations(messages): a llmtrain.Table or llmtrain.Collection of message "
                f"rows, got {type(messages).__name__}"
            )
        self.messages = messages
        self.by, self.order = _check_name("by column", by), _check_name("order column", order)
        self.role, self.content = _check_name("role column", role), _check_name("column", content)

    @property
    def columns(self) -> tuple[str, str, str, str]:
        return self.by, self.order, self.role, self.content

    @property
    def source(self) -> str:
        return f"conversations of {self.messages.source} by {self.by}"

    def to_dict(self) -> dict[str, Any]:
        fields = dict(zip(("by", "order", "role", "content"), self.columns))
        return {"kind": self.kind, "messages": self.messages.to_dict(), **fields}

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> Conversations:
        return super()._from_fields({**data, "messages": Query.from_dict(data["messages"])})


def conversations(rows: Sequence[Sequence[Any]]) -> list[tuple[Any, dict[str, Any]]]:
    """``(key, turn, role, content)`` rows sorted by key and turn as one row a conversation."""
    out: list[tuple[Any, dict[str, Any]]] = []
    for key, turn, role, content in rows:
        if not out or out[-1][0] != key:
            out.append((key, {MESSAGES: [], TURNS: []}))
        out[-1][1][MESSAGES].append({"role": role, "content": content})
        out[-1][1][TURNS].append(turn)
    return out


@dataclass(frozen=True)
class Part:
    """One source of a :class:`Mix`: its rows and the fields it trains (None: fit()'s)."""

    select: Query
    X: str | None = None  # noqa: N815 - fit()'s names
    Y: str | None = None  # noqa: N815

    def to_dict(self) -> dict[str, Any]:
        return {"select": self.select.to_dict(), "X": self.X, "Y": self.Y}

    def fields_or(self, default: Sequence[str]) -> list[str]:
        """The fields this source trains: its own, else ``default`` (fit()'s X and Y)."""
        if self.X is None:
            return list(default)
        return [self.X] if self.Y is None else [self.X, self.Y]


class Mix(Query):
    """Sources of one database, drawn by ``weights`` (default: their sizes; see ``MixOrder``);
    an epoch is ``epoch_rows`` rows (default: their sizes' sum); a source run out starts over."""

    kind = "mix"

    def __init__(
        self,
        parts: Sequence[Query | Part | dict[str, Any]],
        *,
        weights: Sequence[float] | None = None,
        epoch_rows: int | None = None,
    ) -> None:
        self.parts = tuple(_part(p) for p in parts)
        if len(self.parts) < 2:
            raise QueryError("mix() needs at least two sources")
        if weights is not None and (
            not isinstance(weights, (list, tuple))
            or len(weights) != len(self.parts)
            or not all(isinstance(w, (int, float)) and w > 0 for w in weights)
        ):
            raise QueryError(
                f"mix(weights={weights!r}): one positive number for each of the "
                f"{len(self.parts)} sources"
            )
        self.weights = None if weights is None else tuple(float(w) for w in weights)
        if epoch_rows is not None and (not isinstance(epoch_rows, int) or epoch_rows < 1):
            raise QueryError(f"mix(epoch_rows={epoch_rows!r}): a positive number of rows")
        self.epoch_rows = epoch_rows

    @property
    def source(self) -> str:
        return "mix of " + ", ".join(p.select.source for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        parts, weights = [p.to_dict() for p in self.parts], self.weights and list(self.weights)
        return dict(kind=self.kind, parts=parts, weights=weights, epoch_rows=self.epoch_rows)


def _part(part: Query | Part | dict[str, Any]) -> Part:
    if isinstance(part, dict):  # the stored form
        return Part(Query.from_dict(part["select"]), part.get("X"), part.get("Y"))
    if isinstance(part, Conversations):  # one field: its messages
        return Part(part, MESSAGES)
    if isinstance(part, Query) and not isinstance(part, Mix):
        return Part(part)
    if isinstance(part, Part) and not isinstance(part.select, Mix):
        return part
    raise QueryError(f"mix(): a source is a llmtrain query, not {type(part).__name__}")


def mix(
    *sources: Query | Part, weights: Sequence[float] | None = None, epoch_rows: int | None = None
) -> Mix:
    """``mix(lt.Table("docs").fields(X="body"), lt.Table("qa"), weights=[0.75, 0.25])``."""
    return Mix(sources, weights=weights, epoch_rows=epoch_rows)


_KINDS = {q.kind: q for q in (Table, RawSQL, Collection, Conversations, Mix)}


def _refuse_javascript(obj: Any, path: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _JS_OPERATORS:
                raise QueryError(
                    f"{path}: operator {k!r} runs JavaScript on the server; "
                    "pass allow_javascript=True to permit it"
                )
            _refuse_javascript(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _refuse_javascript(v, f"{path}[{i}]")


def _check_params(params: dict[str, Any]) -> None:
    for name, value in params.items():
        if not _NAME.match(name):
            raise QueryError(f"parameter name {name!r} is not a valid identifier")
        if not isinstance(value, (str, int, float, bool, type(None))):
            raise QueryError(
                f"parameter {name!r}: only str, int, float, bool and None are "
                f"stored and replayed, not {type(value).__name__}"
            )
