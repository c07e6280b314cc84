"""MongoDB backend (pymongo, or mongomock with the same calls): keyset pages on ``_id``."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from bson import Binary, Decimal128, Int64, ObjectId
from pymongo.errors import ConnectionFailure

from llmtrain.db.backend import DataBackend, Key, KeyedRows
from llmtrain.db.engines import drop_mongo_client, mongo_database
from llmtrain.db.queries import Collection, Query
from llmtrain.db.sources import Source, match_name
from llmtrain.errors import QueryError

_IN_CHUNK = 1000
_MISSING = object()


def get_path(doc: dict[str, Any], path: str) -> Any:
    """Resolve a dotted path (``"meta.prompt"``); ``_MISSING`` when any step is absent."""
    value: Any = doc
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


# MongoDB's sort order of ``_id`` types, each with its smallest value. ``{"$gte": 5}`` only
# matches numbers (comparisons stay inside a type's bracket), while a sort walks every bracket
# in this order: a page from key ``k`` on is ``k``'s own bracket from ``k`` on, plus every
# later bracket from its start. Timestamp _ids (after dates) are left out: nothing writes
# them, mongomock cannot sort them.
_BRACKETS: list[tuple[tuple[type, ...], Any]] = [
    ((int, float, Int64, Decimal128), float("-inf")),
    ((str,), ""),
    ((dict,), {}),
    ((bytes, Binary, uuid.UUID), Binary(b"")),
    ((ObjectId,), ObjectId(b"\x00" * 12)),
    ((bool,), False),
    ((dt.datetime,), dt.datetime.min),
]


def key_after(lower: Key) -> dict[str, Any]:
    """The condition for ``_id`` >= ``lower`` in MongoDB's sort order, across type brackets
    (ints, strings and ObjectIds in one collection page correctly)."""
    for i, (types, _) in enumerate(_BRACKETS):
        if isinstance(lower, types) and not (isinstance(lower, bool) and i == 0):
            later = [start for _, start in _BRACKETS[i + 1 :]]
            return {"$or": [{"_id": {"$gte": v}} for v in (lower, *later)]}
    return {"_id": {"$gte": lower}}  # a type this table does not know: its own bracket only


class MongoBackend(DataBackend):
    def close(self) -> None:
        drop_mongo_client(self._uri)

    def key_name(self, query: Query) -> str:
        self._query(query)
        return "_id"

    def resolve(self, source: Query | str) -> Source:
        db = mongo_database(self._uri)
        if isinstance(source, str):
            name = source.strip().removeprefix(f"{db.name}.")
        else:
            name = self._query(source).name

        def found() -> Source:
            names = db.list_collection_names()
            name_found = match_name(name, names, "collection", self.uri, fold=False)
            ends = [
                db[name_found].find_one({}, {"_id": 1}, sort=[("_id", order)]) for order in (1, -1)
            ]
            kinds = {int if isinstance(d["_id"], int) else type(d["_id"]) for d in ends if d}
            key_type = kinds.pop() if len(kinds) == 1 else None  # mixed types: keys as given
            return Source(f"{db.name}.{name_found}", "_id", key_type)

        return self._with_retry("reading the collections", found, (ConnectionFailure,))

    def _query(self, query: Query) -> Collection:
        if not isinstance(query, Collection):
            raise QueryError(
                f"{query.source} is a SQL query and cannot run on MongoDB {self.uri}; "
                "use llmtrain.Collection(name).find(...)"
            )
        return query

    def _find(
        self, query: Query, fields: Sequence[str], cond: dict[str, Any], limit: int | None = None
    ) -> KeyedRows:
        """The documents matching the query's filter and ``cond``; with a ``limit``, the
        first ones in ``_id`` order."""
        query = self._query(query)
        both = query.filter and cond
        where = {"$and": [query.filter, cond]} if both else {**query.filter, **cond}
        projection = {"_id": 1, **{f: 1 for f in fields if f != "_id"}}

        def find() -> list[dict[str, Any]]:
            cursor = mongo_database(self._uri)[query.name].find(where, projection)
            return list(cursor if limit is None else cursor.sort("_id", 1).limit(limit))

        # AutoReconnect and NetworkTimeout are ConnectionFailures too
        docs = self._with_retry("reading documents", find, (ConnectionFailure,))
        return [
            (doc["_id"], {f: v for f in fields if (v := get_path(doc, f)) is not _MISSING})
            for doc in docs
        ]

    def fetch_rows(
        self, query: Query, fields: Sequence[str], lower: Key | None, limit: int
    ) -> KeyedRows:
        return self._find(query, fields, {} if lower is None else key_after(lower), limit)

    def fetch_by_keys(self, query: Query, fields: Sequence[str], keys: Sequence[Key]) -> KeyedRows:
        out: KeyedRows = []
        for i in range(0, len(keys), _IN_CHUNK):
            out += self._find(query, fields, {"_id": {"$in": list(keys[i : i + _IN_CHUNK])}})
        return out
