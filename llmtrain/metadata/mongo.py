"""The metadata store in MongoDB (or mongomock): ``_llmtrain_*`` collections, unique indexes.

Payloads, infos and metric values are stored as JSON strings, exactly as in SQL: a component's
payload may itself hold a Mongo query whose ``$``-keys a document field could not take.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pymongo
from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError, PyMongoError

from llmtrain.backends.engines import drop_mongo_client, mongo_database
from llmtrain.errors import StoreError
from llmtrain.metadata.base import MAX_TRIES, TABLE_PREFIX, Conflict, MetadataStore, Row, pause

COMPONENTS = f"{TABLE_PREFIX}components"
RUNS = f"{TABLE_PREFIX}runs"
METRICS = f"{TABLE_PREFIX}metrics"
CHECKPOINTS = f"{TABLE_PREFIX}checkpoints"
_INDEXES: dict[str, list[tuple[list[tuple[str, int]], bool]]] = {
    COMPONENTS: [([("type_id", 1), ("identifier", 1), ("version", 1)], True)],
    RUNS: [([("run_id", 1)], True), ([("type_id", 1), ("identifier", 1)], False)],
    METRICS: [([("run_id", 1), ("step", 1)], False)],
    CHECKPOINTS: [([("run_id", 1), ("step", 1)], True)],
}


class MongoMetadataStore(MetadataStore):
    """Components and runs in ``_llmtrain_*`` collections of the URI's database.

    The unique indexes are created by the first write; reads create no collection or index.
    """

    _driver_errors = (PyMongoError,)

    def __init__(self, uri: str, *, missing_ok: bool = False) -> None:
        super().__init__(uri, missing_ok=missing_ok)  # a missing database reads as empty anyway
        self._indexes_ready = False
        self._index_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    def _coll(self, name: str, *, write: bool = False) -> Collection[Any]:
        """The collection; for a write, after the unique indexes exist."""
        db = mongo_database(self._uri)
        if write and not self._indexes_ready:
            with self._index_lock:
                if not self._indexes_ready:
                    for coll, specs in _INDEXES.items():
                        for keys, unique in specs:
                            db[coll].create_index(keys, unique=unique)
                    self._indexes_ready = True
        return db[name]

    def _insert(self, table: str, row: Row) -> None:
        doc = {**row, "rev": 0} if table == "runs" else dict(row)  # _change_run's revision
        try:
            self._coll(TABLE_PREFIX + table, write=True).insert_one(doc)
        except DuplicateKeyError as exc:
            raise Conflict(str(exc)) from exc

    def _now(self) -> datetime:
        """BSON dates keep milliseconds: truncate so a returned record equals the stored one."""
        now = super()._now()
        return now.replace(microsecond=now.microsecond // 1000 * 1000)

    # -- components ---------------------------------------------------------------------------
    def _insert_component(self, row: Row, same: Callable[[Row], bool]) -> int:
        newest = self._find_component(row["type_id"], row["identifier"], None)
        if newest is not None and same(newest):
            return int(newest["version"])
        version = 0 if newest is None else int(newest["version"]) + 1
        self._insert("components", {**row, "version": version})
        return version

    def _find_component(self, type_id: str, identifier: str, version: int | None) -> Row | None:
        query: dict[str, Any] = {"type_id": type_id, "identifier": identifier}
        if version is None:
            return self._coll(COMPONENTS).find_one(query, sort=[("version", pymongo.DESCENDING)])
        return self._coll(COMPONENTS).find_one({**query, "version": version})

    def _find_components(self, type_id: str | None, identifier: str | None) -> list[Row]:
        return list(self._coll(COMPONENTS).find(_where(type_id=type_id, identifier=identifier)))

    def _delete_components(self, type_id: str, identifier: str, version: int | None) -> int:
        query = _where(type_id=type_id, identifier=identifier, version=version)
        return int(self._coll(COMPONENTS).delete_many(query).deleted_count)

    # -- runs ---------------------------------------------------------------------------------
    def _change_run(self, run_id: str, change: Callable[[Row], dict[str, Any]]) -> Row | None:
        """Compare-and-swap on a revision counter, so concurrent merges lose nothing."""
        coll = self._coll(RUNS)
        for attempt in range(MAX_TRIES):
            doc = coll.find_one({"run_id": run_id})
            if doc is None:
                return None
            rev = doc.get("rev", 0)
            changes = {**change(doc), "rev": rev + 1}
            if (
                coll.update_one({"_id": doc["_id"], "rev": rev}, {"$set": changes}).matched_count
                == 1
            ):
                return {**doc, **changes}
            pause(attempt)
        raise StoreError(f"run {run_id!r}: too many concurrent updates")

    def _find_run(self, run_id: str) -> Row | None:
        return self._coll(RUNS).find_one({"run_id": run_id})

    def _find_runs(self, type_id: str | None, identifier: str | None) -> list[Row]:
        query = _where(type_id=type_id, identifier=identifier)
        return list(self._coll(RUNS).find(query).sort([("created_at", 1), ("_id", 1)]))

    def _delete_run(self, run_id: str) -> None:
        for name in (CHECKPOINTS, METRICS, RUNS):
            self._coll(name).delete_many({"run_id": run_id})

    # -- metrics and checkpoints ----------------------------------------------------------------
    def _insert_metrics(self, row: Row, without_these: Callable[[Row], str | None]) -> None:
        """One writer per run (rank 0): the replace needs no transaction."""
        coll = self._coll(METRICS, write=True)
        for old in coll.find({"run_id": row["run_id"], "step": row["step"]}):
            kept = without_these(old)
            if kept is None:
                coll.delete_one({"_id": old["_id"]})
            elif kept != old["values"]:
                coll.update_one({"_id": old["_id"]}, {"$set": {"values": kept}})
        self._insert("metrics", row)

    def _find_metrics(self, run_id: str) -> list[Row]:
        # ObjectIds grow within a process: (step, _id) is insertion order per step.
        return list(self._coll(METRICS).find({"run_id": run_id}).sort([("step", 1), ("_id", 1)]))

    def _find_checkpoints(self, run_id: str) -> list[Row]:
        return list(self._coll(CHECKPOINTS).find({"run_id": run_id}).sort("step", 1))

    def _delete_checkpoint(self, run_id: str, step: int) -> None:
        self._coll(CHECKPOINTS).delete_one({"run_id": run_id, "step": step})

    def close(self) -> None:
        drop_mongo_client(self._uri)


def _where(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}
