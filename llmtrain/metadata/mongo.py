"""The metadata store in MongoDB (or mongomock): ``_llmtrain_*`` collections, unique indexes.

Payloads, infos and metric values are stored as JSON strings, exactly as in SQL: a component's
payload may itself hold a Mongo query whose ``$``-keys a document field could not take.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import pymongo
from pymongo.errors import DuplicateKeyError, PyMongoError

from llmtrain.backends.engines import drop_mongo_client, mongo_database
from llmtrain.errors import ComponentNotFoundError, StoreError
from llmtrain.metadata.base import (
    TABLE_PREFIX,
    CheckpointRecord,
    ComponentRecord,
    MetadataStore,
    MetricRecord,
    RunRecord,
    RunStatus,
)
from llmtrain.metadata.records import (
    MAX_TRIES,
    UTC,
    check_status,
    component_record,
    dumps,
    float_values,
    pause,
)

T = TypeVar("T")
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


def now_ms() -> datetime:
    """BSON dates keep milliseconds: truncate so a returned record equals the stored one."""
    now = datetime.now(UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def as_utc(value: datetime) -> datetime:
    """pymongo and mongomock hand back naive UTC unless the client is ``tz_aware``."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class MongoMetadataStore(MetadataStore):
    """Components and runs in ``_llmtrain_*`` collections of the URI's database."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self._indexes_ready = False
        self._index_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except PyMongoError as exc:
            raise StoreError(f"metadata store {self._where}: {what} failed: "
                             f"{type(exc).__name__}: {exc}") from exc

    def _coll(self, name: str) -> Any:
        db = mongo_database(self._uri)
        if not self._indexes_ready:
            with self._index_lock:
                if not self._indexes_ready:
                    for coll, specs in _INDEXES.items():
                        for keys, unique in specs:
                            db[coll].create_index(keys, unique=unique)
                    self._indexes_ready = True
        return db[name]

    def _retry(self, fn: Callable[[], T]) -> T:
        """Another writer took the same unique key first: read again and retry."""
        for attempt in range(MAX_TRIES):
            try:
                return fn()
            except DuplicateKeyError:
                if attempt == MAX_TRIES - 1:
                    raise
                pause(attempt)
        raise AssertionError("unreachable")

    # -- components ---------------------------------------------------------------------------
    def add_component(self, type_id: str, identifier: str, payload: dict[str, Any]) -> int:
        if not isinstance(payload, dict):
            raise StoreError(f"{type_id} {identifier!r}: payload must be a dict, "
                             f"got {type(payload).__name__}")
        text = dumps(payload, f"{type_id} {identifier!r} payload")

        def insert() -> int:
            coll = self._coll(COMPONENTS)
            newest = coll.find_one({"type_id": type_id, "identifier": identifier},
                                   sort=[("version", pymongo.DESCENDING)])
            version = 0 if newest is None else int(newest["version"]) + 1
            coll.insert_one({"type_id": type_id, "identifier": identifier, "version": version,
                             "created_at": now_ms(), "payload": text})
            return version

        with self._errors(f"adding {type_id} {identifier!r}"):
            return self._retry(insert)

    def get_component(self, type_id: str, identifier: str,
                      version: int | None = None) -> ComponentRecord:
        query: dict[str, Any] = {"type_id": type_id, "identifier": identifier}
        with self._errors(f"reading {type_id} {identifier!r}"):
            coll = self._coll(COMPONENTS)
            if version is None:
                doc = coll.find_one(query, sort=[("version", pymongo.DESCENDING)])
            else:
                doc = coll.find_one({**query, "version": version})
        if doc is None:
            which = "any version" if version is None else f"version {version}"
            raise ComponentNotFoundError(
                f"no {type_id} {identifier!r} ({which}) in {self._where}")
        return _component(doc)

    def list_components(self, type_id: str | None = None,
                        identifier: str | None = None) -> list[ComponentRecord]:
        query = _where(type_id=type_id, identifier=identifier)
        with self._errors("listing components"):
            records = [_component(d) for d in self._coll(COMPONENTS).find(query)]
        return sorted(records, key=lambda r: (r.type_id, r.identifier, r.version))

    def remove_component(self, type_id: str, identifier: str, version: int | None = None) -> int:
        query = _where(type_id=type_id, identifier=identifier, version=version)
        with self._errors(f"removing {type_id} {identifier!r}"):
            return int(self._coll(COMPONENTS).delete_many(query).deleted_count)

    # -- runs ---------------------------------------------------------------------------------
    def create_run(self, run_id: str, type_id: str, identifier: str, version: int,
                   info: dict[str, Any]) -> RunRecord:
        now = now_ms()
        record = RunRecord(run_id=run_id, type_id=type_id, identifier=identifier,
                           version=version, status="created", created_at=now, updated_at=now,
                           info=dict(info))
        doc = {**record.model_dump(exclude={"info"}),
               "info": dumps(record.info, f"run {run_id!r} info"), "rev": 0}
        try:
            with self._errors(f"creating run {run_id!r}"):
                self._coll(RUNS).insert_one(doc)
        except StoreError as exc:
            if isinstance(exc.__cause__, DuplicateKeyError):
                raise StoreError(f"run {run_id!r} already exists in {self._where}") from None
            raise
        return record

    def update_run(self, run_id: str, *, status: RunStatus | None = None,
                   info: dict[str, Any] | None = None, error: str | None = None) -> RunRecord:
        """Compare-and-swap on a revision counter, so concurrent merges lose nothing."""
        if status is not None:
            check_status(status)
        with self._errors(f"updating run {run_id!r}"):
            coll = self._coll(RUNS)
            for attempt in range(MAX_TRIES):
                doc = coll.find_one({"run_id": run_id})
                if doc is None:
                    raise StoreError(f"no run {run_id!r} in {self._where}")
                record = _run(doc)
                changes: dict[str, Any] = {"updated_at": now_ms()}
                if status is not None:
                    changes["status"] = status
                if error is not None:
                    changes["error"] = error
                elif status in ("running", "completed"):
                    changes["error"] = None  # a run going again, or done, carries no old failure
                merged = {**record.info, **(info or {})}
                stored = {**changes, "info": dumps(merged, f"run {run_id!r} info"),
                          "rev": doc.get("rev", 0) + 1}
                result = coll.update_one({"_id": doc["_id"], "rev": doc.get("rev", 0)},
                                         {"$set": stored})
                if result.matched_count == 1:
                    return record.model_copy(update={**changes, "info": merged})
                pause(attempt)
        raise StoreError(f"run {run_id!r}: too many concurrent updates")

    def get_run(self, run_id: str) -> RunRecord:
        with self._errors(f"reading run {run_id!r}"):
            doc = self._coll(RUNS).find_one({"run_id": run_id})
        if doc is None:
            raise StoreError(f"no run {run_id!r} in {self._where}")
        return _run(doc)

    def list_runs(self, type_id: str | None = None,
                  identifier: str | None = None) -> list[RunRecord]:
        query = _where(type_id=type_id, identifier=identifier)
        with self._errors("listing runs"):
            docs = self._coll(RUNS).find(query).sort([("created_at", 1), ("_id", 1)])
            return [_run(d) for d in docs]

    # -- metrics and checkpoints ----------------------------------------------------------------
    def log_metrics(self, run_id: str, step: int, values: dict[str, float]) -> None:
        text = dumps(float_values(values), f"run {run_id!r} metrics")
        with self._errors(f"logging metrics of run {run_id!r}"):
            self._coll(METRICS).insert_one({"run_id": run_id, "step": int(step),
                                            "values": text, "created_at": now_ms()})

    def get_metrics(self, run_id: str) -> list[MetricRecord]:
        with self._errors(f"reading metrics of run {run_id!r}"):
            # ObjectIds grow within a process: (step, _id) is insertion order per step.
            docs = self._coll(METRICS).find({"run_id": run_id}).sort(
                [("step", 1), ("_id", 1)])
            return [MetricRecord(run_id=d["run_id"], step=d["step"],
                                 values=json.loads(d["values"]),
                                 created_at=as_utc(d["created_at"])) for d in docs]

    def add_checkpoint(self, run_id: str, step: int, artifact_id: str,
                       info: dict[str, Any]) -> CheckpointRecord:
        record = CheckpointRecord(run_id=run_id, step=step, artifact_id=artifact_id,
                                  created_at=now_ms(), info=dict(info))
        doc = {**record.model_dump(exclude={"info"}),
               "info": dumps(record.info, f"checkpoint info of run {run_id!r}")}
        try:
            with self._errors(f"adding checkpoint {step} of run {run_id!r}"):
                self._coll(CHECKPOINTS).insert_one(doc)
        except StoreError as exc:
            if isinstance(exc.__cause__, DuplicateKeyError):
                raise StoreError(f"run {run_id!r} already has a checkpoint at step "
                                 f"{step}") from None
            raise
        return record

    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        with self._errors(f"listing checkpoints of run {run_id!r}"):
            docs = self._coll(CHECKPOINTS).find({"run_id": run_id}).sort("step", 1)
            return [CheckpointRecord(run_id=d["run_id"], step=d["step"],
                                     artifact_id=d["artifact_id"],
                                     created_at=as_utc(d["created_at"]),
                                     info=json.loads(d["info"])) for d in docs]

    def remove_checkpoint(self, run_id: str, step: int) -> None:
        """Removing one that is not there is a no-op (retention may run twice)."""
        with self._errors(f"removing checkpoint {step} of run {run_id!r}"):
            self._coll(CHECKPOINTS).delete_one({"run_id": run_id, "step": step})

    def close(self) -> None:
        drop_mongo_client(self._uri)


def _where(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _component(doc: dict[str, Any]) -> ComponentRecord:
    created = doc.get("created_at")
    return component_record(doc.get("type_id"), doc.get("identifier"), doc.get("version"),
                            as_utc(created) if isinstance(created, datetime) else created,
                            doc.get("payload"))


def _run(doc: dict[str, Any]) -> RunRecord:
    return RunRecord(run_id=doc["run_id"], type_id=doc["type_id"], identifier=doc["identifier"],
                     version=doc["version"], status=doc["status"],
                     created_at=as_utc(doc["created_at"]), updated_at=as_utc(doc["updated_at"]),
                     info=json.loads(doc["info"]), error=doc.get("error"))
