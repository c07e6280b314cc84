"""MongoDB backend (pymongo, or mongomock with the same calls): keyset pages on ``_id``."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from bson import Binary, Decimal128, Int64, ObjectId
from pymongo.errors import ConnectionFailure

from llmtrain.db.backend import DataBackend, Fields, Key, KeyedRows
from llmtrain.db.engines import drop_mongo_client, mongo_database
from llmtrain.db.queries import TURNS, Collection, Conversations, Query, conversations
from llmtrain.db.sources import Source, match_name
from llmtrain.errors import QueryError

_MISSING = object()
FORGOTTEN = "_llmtrain_forgotten"  # {source, key}: keys db.forget left out, matched by MongoDB


def get_path(doc: dict[str, Any], path: str, missing: Any = _MISSING) -> Any:
    """Resolve a dotted path (``"meta.prompt"``); ``missing`` when any step is absent."""
    value: Any = doc
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return missing
        value = value[part]
    return value


# MongoDB's sort order of ``_id`` types, each with its smallest value: ``$gte`` stays inside a
# type's bracket while a sort walks them all, so a page from ``k`` on is ``k``'s bracket from
# ``k`` on plus every later bracket (Timestamps left out: mongomock cannot sort them).
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
    """The condition for ``_id`` >= ``lower`` in MongoDB's sort order, across type brackets."""
    for i, (types, _) in enumerate(_BRACKETS):
        if isinstance(lower, types) and not (isinstance(lower, bool) and i == 0):
            later = [start for _, start in _BRACKETS[i + 1 :]]
            return {"$or": [{"_id": {"$gte": v}} for v in (lower, *later)]}
    return {"_id": {"$gte": lower}}  # a type this table does not know: its own bracket only


def store_keys(database: Any, identity: str, keys: list[Key]) -> list[tuple[int, Key]]:
    """Add ``keys`` to a collection's forgotten keys; (position, key) of each that matches."""
    database[FORGOTTEN].insert_many([{"source": identity, "key": k} for k in keys])
    name = identity.split(".", 1)[1].removesuffix("(_id)")
    found = {repr(d["_id"]) for d in database[name].find({"_id": {"$in": keys}}, {"_id": 1})}
    return [(i, k) for i, k in enumerate(keys) if repr(k) in found]


class MongoBackend(DataBackend):
    def close(self) -> None:
        drop_mongo_client(self._uri)

    def reads(self, query: Query) -> list[str]:
        return [f"{mongo_database(self._uri).name}.{self._query(query).name}"]

    def derived_keys(self, query: Query, source: Source, keys: Sequence[Key]) -> list[Key]:
        rows = self._query(query)
        if not isinstance(query, Conversations) or source.name != self.reads(query)[0]:
            return []
        cond = {"$and": [rows.filter, {"_id": {"$in": list(keys)}}]}
        return self._read("reading messages", rows.name, lambda c: c.distinct(query.by, cond))

    def forget_keys(self, source: Source, keys: Sequence[Key]) -> list[tuple[int, Key]]:
        database = mongo_database(self._uri)
        return self._with_retry(
            "writing forgotten keys",
            lambda: store_keys(database, source.identity, list(keys)),
            (ConnectionFailure,),
        )

    def _left_out(self, name: str, by: str | None = None) -> dict[str, Any]:
        """The condition leaving out forgotten documents; a view is refused: it is not rewritten."""
        db = mongo_database(self._uri)
        if FORGOTTEN not in db.list_collection_names():
            return {}
        try:
            kind = next((c.get("type") for c in db.list_collections(filter={"name": name})), None)
        except NotImplementedError:  # mongomock, which has no views
            kind = None
        if kind == "view" and db[FORGOTTEN].count_documents({}, limit=1):
            raise QueryError(
                f"collection {name} is a view and this database has forgotten documents "
                "(db.forget): select the collection it reads, so they are left out"
            )
        keys = [d["key"] for d in db[FORGOTTEN].find({"source": f"{db.name}.{name}(_id)"})]
        if not keys:
            return {}
        if by is None:
            return {"_id": {"$nin": keys}}
        gone = db[name].distinct(by, {"_id": {"$in": keys}})  # a conversation goes whole
        return {"$and": [{"_id": {"$nin": keys}}, {by: {"$nin": gone}}]}

    def key_name(self, query: Query) -> str:
        self._query(query)
        return query.by if isinstance(query, Conversations) else "_id"

    def resolve(self, source: Query | str) -> Source:
        db = mongo_database(self._uri)
        if isinstance(source, str):
            name, key = source.strip().removeprefix(f"{db.name}."), "_id"
        else:
            name, key = self._query(source).name, self.key_name(source)

        def found() -> Source:
            name_found = match_name(name, db.list_collection_names(), "collection", self.uri, False)
            ends = [
                db[name_found].find_one({key: {"$exists": True}}, {key: 1}, sort=[(key, order)])
                for order in (1, -1)
            ]
            kinds = {int if isinstance(d[key], int) else type(d[key]) for d in ends if d}
            key_type = kinds.pop() if len(kinds) == 1 else None  # mixed types: keys as given
            return Source(f"{db.name}.{name_found}", key, key_type)

        return self._with_retry("reading the collections", found, (ConnectionFailure,))

    def _query(self, query: Query) -> Collection:
        if isinstance(query, Conversations):
            query = query.messages
        if not isinstance(query, Collection):
            raise QueryError(
                f"{query.source} is a SQL query and cannot run on MongoDB {self.uri}; "
                "use llmtrain.Collection(name).find(...)"
            )
        return query

    def _read(self, what: str, name: str, read: Callable[[Any], Any]) -> list[Any]:
        """``read(collection)``'s documents, retried on a ConnectionFailure (AutoReconnect too)."""
        return self._with_retry(
            what, lambda: list(read(mongo_database(self._uri)[name])), (ConnectionFailure,)
        )

    def _find(
        self, query: Query, fields: Fields, cond: dict[str, Any], limit: int | None = None
    ) -> KeyedRows:
        """The documents matching the filter and ``cond``; with a ``limit``, in ``_id`` order."""
        query = self._query(query)
        parts = [c for c in (query.filter, cond, self._left_out(query.name)) if c]
        where = {"$and": parts} if parts else {}
        projection = {"_id": 1, **{f: 1 for f in fields if f != "_id"}}

        def find(collection: Any) -> Any:
            cursor = collection.find(where, projection)
            return cursor if limit is None else cursor.sort("_id", 1).limit(limit)

        docs = self._read("reading documents", query.name, find)
        return [
            (doc["_id"], {f: v for f in fields if (v := get_path(doc, f)) is not _MISSING})
            for doc in docs
        ]

    def _page(self, query: Query, fields: Fields, lower: Key | None, limit: int) -> KeyedRows:
        if not isinstance(query, Conversations):
            return self._find(query, fields, {} if lower is None else key_after(lower), limit)
        by, order, messages = f"${query.by}", f"${query.order}", self._query(query)
        left_out = self._left_out(messages.name, query.by)
        pipeline: list[dict[str, Any]] = [
            {"$match": {"$and": [messages.filter, {query.by: {"$exists": True}}, left_out]}},
            {"$group": {"_id": by, TURNS: {"$max": order}}},
            *([] if lower is None else [{"$match": {"_id": {"$gte": lower}}}]),
            {"$sort": {"_id": 1}},
            {"$limit": limit},
        ]
        groups = self._read("reading conversations", messages.name, lambda c: c.aggregate(pipeline))
        return [(g["_id"], {TURNS: g[TURNS]}) for g in groups]

    def _by_keys(self, query: Query, fields: Fields, keys: list[Key]) -> KeyedRows:
        if not isinstance(query, Conversations):
            return self._find(query, fields, {"_id": {"$in": keys}})
        messages = self._query(query)
        left_out = self._left_out(messages.name, query.by)
        cond = {"$and": [messages.filter, {query.by: {"$in": keys}}, left_out]}
        sort = [(query.by, 1), (query.order, 1)]
        docs = self._read("reading messages", messages.name, lambda c: c.find(cond).sort(sort))
        return conversations([[get_path(d, f, None) for f in query.columns] for d in docs])
