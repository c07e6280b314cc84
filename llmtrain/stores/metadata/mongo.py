"""The metadata store in MongoDB: ``_llmtrain_*`` collections; JSON as strings, as in SQL (a
payload may hold a Mongo query whose ``$``-keys a document field could not take)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError, PyMongoError

from llmtrain.db.engines import drop_mongo_client, mongo_database
from llmtrain.errors import StoreError
from llmtrain.stores.metadata.base import (
    MAX_TRIES,
    TABLE_PREFIX,
    Conflict,
    MetadataStore,
    Row,
    pause,
)

_ORDER = {  # metrics by step, then insertion: ObjectIds grow in the one process writing them
    "components": ("version",),
    "runs": ("created_at", "_id"),
    "metrics": ("step", "_id"),
    "checkpoints": ("step",),
}
_INDEXES: dict[str, list[tuple[list[tuple[str, int]], bool]]] = {
    "components": [([("type_id", 1), ("identifier", 1), ("version", 1)], True)],
    "runs": [([("run_id", 1)], True), ([("type_id", 1), ("identifier", 1)], False)],
    "metrics": [([("run_id", 1), ("step", 1)], False)],
    "checkpoints": [([("run_id", 1), ("step", 1)], True)],
}


class MongoMetadataStore(MetadataStore):
    """Indexes are created by the first write; reads create nothing (so ``missing_ok`` is moot)."""

    _driver_errors = (PyMongoError,)
    _indexes_ready = False

    def _coll(self, table: str, *, write: bool = False) -> Collection[Any]:
        """For a write, after the indexes exist (creating one twice is harmless)."""
        db = mongo_database(self._uri)
        if write and not self._indexes_ready:
            for coll, specs in _INDEXES.items():
                for keys, unique in specs:
                    db[TABLE_PREFIX + coll].create_index(keys, unique=unique)
            self._indexes_ready = True
        return db[TABLE_PREFIX + table]

    def _insert(self, table: str, row: Row) -> None:
        doc = {**row, "rev": 0} if table == "runs" else dict(row)  # _change_run's revision
        try:
            self._coll(table, write=True).insert_one(doc)
        except DuplicateKeyError as exc:
            raise Conflict(str(exc)) from exc

    def _now(self) -> datetime:
        """BSON dates keep milliseconds: truncate so a returned record equals the stored one."""
        now = super()._now()
        return now.replace(microsecond=now.microsecond // 1000 * 1000)

    def _find(self, table: str, newest: bool = False, **equal: Any) -> list[Row]:
        order = [(key, -1 if newest else 1) for key in _ORDER[table]]
        found = self._coll(table).find(equal).sort(order)
        return list(found.limit(1) if newest else found)

    def _delete(self, tables: list[str], **equal: Any) -> int:
        return sum(self._coll(t).delete_many(equal).deleted_count for t in tables)

    def _change_run(self, run_id: str, change: Callable[[Row], dict[str, Any]]) -> Row | None:
        """Compare-and-swap on a revision counter, so concurrent merges lose nothing."""
        coll = self._coll("runs")
        for attempt in range(MAX_TRIES):
            doc = coll.find_one({"run_id": run_id})
            if doc is None:
                return None
            rev = doc.get("rev", 0)
            changes = {**change(doc), "rev": rev + 1}
            if coll.update_one({"_id": doc["_id"], "rev": rev}, {"$set": changes}).matched_count:
                return {**doc, **changes}
            pause(attempt)
        raise StoreError(f"run {run_id!r}: too many concurrent updates")

    def _insert_metrics(self, row: Row, without_these: Callable[[Row], str | None]) -> None:
        """One writer per run (rank 0): the replace needs no transaction."""
        coll = self._coll("metrics", write=True)
        for old in coll.find({"run_id": row["run_id"], "step": row["step"]}):
            kept = without_these(old)
            if kept is None:
                coll.delete_one({"_id": old["_id"]})
            elif kept != old["values"]:
                coll.update_one({"_id": old["_id"]}, {"$set": {"values": kept}})
        self._insert("metrics", row)

    def close(self) -> None:
        drop_mongo_client(self._uri)
