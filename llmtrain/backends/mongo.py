"""MongoDB backend (pymongo, or mongomock with the same calls): keyset pages on ``_id``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmtrain.backends.base import DataBackend, Key, KeyScan, Row
from llmtrain.backends.engines import drop_mongo_client, mongo_database
from llmtrain.backends.retry import RetryPolicy, with_retry
from llmtrain.errors import QueryError
from llmtrain.queries import Collection, Query
from llmtrain.uri import redact_uri

_KEY_PAGE = 50_000
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


def _transient_errors() -> tuple[type[BaseException], ...]:
    from pymongo.errors import AutoReconnect, ConnectionFailure, NetworkTimeout

    return (AutoReconnect, ConnectionFailure, NetworkTimeout)


class MongoBackend(DataBackend):
    def __init__(self, uri: str, *, retry: RetryPolicy | None = None) -> None:
        self._uri = uri
        self.uri = redact_uri(uri)
        self.retry = retry or RetryPolicy()

    def _collection(self, query: Query) -> Any:
        if not isinstance(query, Collection):
            raise QueryError(
                f"{type(query).__name__} cannot run on MongoDB {self.uri}; "
                "use llmtrain.Collection(name).find(...)"
            )
        return mongo_database(self._uri)[query.name]

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

    def scan_keys(self, query: Query, block_size: int) -> KeyScan:
        """Walks ``_id`` only, in short keyset pages, keeping every ``block_size``-th key."""
        assert isinstance(query, Collection)
        boundaries: list[Key] = []
        count, last = 0, None
        while True:
            cond = None if last is None else {"_id": {"$gt": last}}
            page = self._run(
                "scanning keys",
                lambda cond=cond: [
                    d["_id"]
                    for d in self._collection(query)
                    .find(self._where(query, cond), {"_id": 1})
                    .sort("_id", 1)
                    .limit(_KEY_PAGE)
                ],
            )
            for i, key in enumerate(page):
                if (count + i) % block_size == 0:
                    boundaries.append(key)
            count += len(page)
            if len(page) < _KEY_PAGE:
                break
            last = page[-1]
        if page:
            last = page[-1]
        return KeyScan(count, block_size, boundaries, last if count else None)

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
        assert isinstance(query, Collection)
        cond = None if lower is None else {"_id": {"$gte" if inclusive else "$gt": lower}}
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

    def fetch_keys(self, query: Query, lower: Key, limit: int) -> list[Key]:
        assert isinstance(query, Collection)
        return self._run(
            "reading keys",
            lambda: [
                d["_id"]
                for d in self._collection(query)
                .find(self._where(query, {"_id": {"$gte": lower}}), {"_id": 1})
                .sort("_id", 1)
                .limit(limit)
            ],
        )

    def fetch_by_keys(
        self, query: Query, fields: Sequence[str], keys: Sequence[Key]
    ) -> list[tuple[Key, Row]]:
        assert isinstance(query, Collection)
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
