"""MongoDB backend (pymongo, or mongomock with the same calls): keyset pages on ``_id``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmtrain.backends.base import DataBackend, Key, Row
from llmtrain.backends.engines import drop_mongo_client, mongo_database
from llmtrain.backends.retry import RetryPolicy, with_retry
from llmtrain.errors import QueryError
from llmtrain.queries import Collection, Query
from llmtrain.uri import redact_uri

_IN_CHUNK = 1000
_MISSING = object()


def get_path(doc: dict[str, Any], path: str) -> Any:
    """Resolve a dotted path (``"meta.prompt"``); ``_MISSING`` when any step is absent."""
    value: Any = doc
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return _MISSING
    return value


def _brackets() -> list[tuple[tuple[type, ...], Any]]:
    """MongoDB's sort order of ``_id`` types, each with its smallest value.

    ``{"$gt": 5}`` only matches numbers (comparisons stay inside a type's bracket), while
    a sort walks every bracket in this order: a page after key ``k`` is ``k``'s own bracket
    from ``k`` on, plus every later bracket from its start.
    """
    import datetime as dt
    import uuid

    from bson import Binary, Decimal128, Int64, ObjectId

    return [
        ((int, float, Int64, Decimal128), float("-inf")),
        ((str,), ""),
        ((dict,), {}),
        ((bytes, Binary, uuid.UUID), Binary(b"")),
        ((ObjectId,), ObjectId(b"\x00" * 12)),
        ((bool,), False),
        ((dt.datetime,), dt.datetime.min),
    ]  # Timestamp _ids (after dates) are left out: nothing writes them, mongomock cannot sort them


def key_after(lower: Key, *, inclusive: bool) -> dict[str, Any]:
    """The condition for ``_id`` >= ``lower`` (> unless inclusive) in MongoDB's sort order,
    across type brackets (ints, strings and ObjectIds in one collection page correctly)."""
    brackets = _brackets()
    own = next(
        (
            i
            for i, (types, _) in enumerate(brackets)
            if isinstance(lower, types) and not (isinstance(lower, bool) and i == 0)
        ),
        None,
    )
    cond = {"_id": {"$gte" if inclusive else "$gt": lower}}
    if own is None:  # a type this table does not know: its own bracket only, as before
        return cond
    later = [{"_id": {"$gte": start}} for _, start in brackets[own + 1 :]]
    return {"$or": [cond, *later]}


def _transient_errors() -> tuple[type[BaseException], ...]:
    from pymongo.errors import AutoReconnect, ConnectionFailure, NetworkTimeout

    return (AutoReconnect, ConnectionFailure, NetworkTimeout)


class MongoBackend(DataBackend):
    def __init__(self, uri: str, *, retry: RetryPolicy | None = None) -> None:
        self._uri = uri
        self.uri = redact_uri(uri)
        self.retry = retry or RetryPolicy()

    def _collection(self, query: Query) -> Any:
        return mongo_database(self._uri)[self._query(query).name]

    def _query(self, query: Query) -> Collection:
        if not isinstance(query, Collection):
            raise QueryError(
                f"{query.source} is a SQL query and cannot run on MongoDB {self.uri}; "
                "use llmtrain.Collection(name).find(...)"
            )
        return query

    def _run(self, what: str, call: Any) -> Any:
        return with_retry(
            call,
            policy=self.retry,
            transient=_transient_errors(),
            reconnect=self.reconnect,
            what=what,
            where=self.uri,
        )

    def close(self) -> None:
        drop_mongo_client(self._uri)

    @staticmethod
    def _where(query: Collection, key_condition: dict[str, Any] | None) -> dict[str, Any]:
        parts = [p for p in (query.filter, key_condition) if p]
        if not parts:
            return {}
        return parts[0] if len(parts) == 1 else {"$and": parts}

    def key_name(self, query: Query) -> str:
        self._collection(query)
        return "_id"

    def _projection(self, fields: Sequence[str]) -> dict[str, int]:
        return {"_id": 1, **{f: 1 for f in fields if f != "_id"}}

    @staticmethod
    def _rows(docs: list[dict[str, Any]], fields: Sequence[str]) -> list[tuple[Key, Row]]:
        out = []
        for doc in docs:
            row = {}
            for f in fields:
                value = get_path(doc, f)
                if value is not _MISSING:
                    row[f] = value
            out.append((doc["_id"], row))
        return out

    def fetch_rows(
        self,
        query: Query,
        fields: Sequence[str],
        lower: Key | None,
        limit: int,
        *,
        inclusive: bool = True,
    ) -> list[tuple[Key, Row]]:
        query = self._query(query)
        cond = None if lower is None else key_after(lower, inclusive=inclusive)
        docs = self._run(
            "reading documents",
            lambda: list(
                self._collection(query)
                .find(self._where(query, cond), self._projection(fields))
                .sort("_id", 1)
                .limit(limit)
            ),
        )
        return self._rows(docs, fields)

    def fetch_by_keys(
        self, query: Query, fields: Sequence[str], keys: Sequence[Key]
    ) -> list[tuple[Key, Row]]:
        query = self._query(query)
        out: list[tuple[Key, Row]] = []
        for i in range(0, len(keys), _IN_CHUNK):
            chunk = list(keys[i : i + _IN_CHUNK])
            docs = self._run(
                "reading documents",
                lambda chunk=chunk: list(
                    self._collection(query).find(
                        self._where(query, {"_id": {"$in": chunk}}), self._projection(fields)
                    )
                ),
            )
            out.extend(self._rows(docs, fields))
        return out
