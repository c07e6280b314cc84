"""Components (versioned), runs, metrics, checkpoints: as JSON, pydantic-checked, never pickled."""

from __future__ import annotations

import json
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from llmtrain.errors import ComponentNotFoundError, StoreError
from llmtrain.uri import redact_uri

R = TypeVar("R", bound=BaseModel)
TABLE_PREFIX = "_llmtrain_"
UTC = timezone.utc
RunStatus = Literal["created", "running", "completed", "failed", "interrupted"]
_RUN_STATUSES = frozenset(get_args(RunStatus))
MAX_TRIES = 50  # a writer's tries after losing a race, each one short transaction


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ComponentRecord(_Record):
    type_id: str
    identifier: str
    version: int
    created_at: datetime
    payload: dict[str, Any]


class RunRecord(_Record):
    run_id: str
    type_id: str
    identifier: str
    version: int
    status: RunStatus
    created_at: datetime
    updated_at: datetime
    info: dict[str, Any]
    error: str | None = None


class MetricRecord(_Record):
    run_id: str
    step: int
    values: dict[str, float]
    created_at: datetime


class CheckpointRecord(_Record):
    run_id: str
    step: int
    artifact_id: str
    created_at: datetime
    info: dict[str, Any]


Info = TypeVar("Info", RunRecord, CheckpointRecord)  # a record with an ``info`` dict


class Conflict(Exception):
    """A backend primitive's signal: another record already holds that unique key."""


Row = Mapping[str, Any]  # a backend primitive's row: column -> value, JSON still as text


class MetadataStore(ABC):
    """The rules, once, over a backend's ``_``-primitives (which create nothing when only read)."""

    _driver_errors: tuple[type[BaseException], ...] = ()  # what becomes a StoreError

    def __init__(self, uri: str, *, missing_ok: bool = False) -> None:
        self._uri = uri
        self._where = redact_uri(uri)
        self._missing_ok = missing_ok

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._where!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its URI: another process reconnects (and checks) lazily."""
        return (type(self), (self._uri,), {"_missing_ok": self._missing_ok})

    def add_component(
        self,
        type_id: str,
        identifier: str,
        payload: dict[str, Any],
        *,
        unless_unchanged: bool = False,
    ) -> int:
        """The new version's number; ``unless_unchanged``: the newest's if its payload is equal."""
        what = f"{type_id} {identifier!r}"
        if not isinstance(payload, dict):
            raise StoreError(f"{what}: payload must be a dict, got {type(payload).__name__}")
        text = dumps(payload, f"{what} payload")
        stored = json.loads(text)  # as it reads back: tuples become lists

        def same(newest: Row) -> bool:
            return unless_unchanged and loads(newest["payload"], what) == stored

        row = {"type_id": type_id, "identifier": identifier, "payload": text}
        with self._errors(f"adding {what}"):
            for attempt in range(MAX_TRIES):
                try:
                    return self._insert_component({**row, "created_at": self._now()}, same)
                except Conflict:  # another writer took that version first: read again, retry
                    pause(attempt)
        raise StoreError(
            f"metadata store {self._where}: lost the race for a new version {MAX_TRIES} times"
        )

    def get_component(
        self, type_id: str, identifier: str, version: int | None = None
    ) -> ComponentRecord:
        what = f"{type_id} {identifier!r}"
        filters = {"type_id": type_id, "identifier": identifier, **_given(version=version)}
        rows = self._rows(f"reading {what}", "components", version is None, **filters)
        if not rows:
            which = "any version" if version is None else f"version {version}"
            raise ComponentNotFoundError(f"no {what} ({which}) in {self._where}")
        return _component(rows[0])

    def list_components(
        self, type_id: str | None = None, identifier: str | None = None
    ) -> list[ComponentRecord]:
        """Ordered by type_id, identifier, version: by code point, whatever the collation."""
        filters = _given(type_id=type_id, identifier=identifier)
        rows = self._rows("listing components", "components", **filters)
        return sorted(map(_component, rows), key=lambda r: (r.type_id, r.identifier, r.version))

    def remove_component(self, type_id: str, identifier: str, version: int | None = None) -> int:
        """Remove one version (or all when version is None); return how many went."""
        filters = {"type_id": type_id, "identifier": identifier, **_given(version=version)}
        with self._errors(f"removing {type_id} {identifier!r}"):
            return self._delete(["components"], **filters)

    def create_run(
        self, run_id: str, type_id: str, identifier: str, version: int, info: dict[str, Any]
    ) -> RunRecord:
        now = self._now()
        record = RunRecord(
            run_id=run_id,
            type_id=type_id,
            identifier=identifier,
            version=version,
            status="created",
            created_at=now,
            updated_at=now,
            info=dict(info),
        )
        taken = f"run {run_id!r} already exists in {self._where}"
        return self._add("runs", record, f"run {run_id!r}", taken)

    def update_run(
        self,
        run_id: str,
        *,
        status: RunStatus | None = None,
        info: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> RunRecord:
        """Merges ``info`` into the stored info; ``running``/``completed`` clear the error."""
        if status is not None and status not in _RUN_STATUSES:
            raise StoreError(
                f"run status {status!r} is invalid: use one of {', '.join(sorted(_RUN_STATUSES))}"
            )

        changes: dict[str, Any] = _given(status=status, error=error)
        if error is None and status in ("running", "completed"):
            changes["error"] = None  # a run going again, or done, carries no old failure

        def change(row: Row) -> dict[str, Any]:
            merged = dumps({**_run(row).info, **(info or {})}, f"run {run_id!r} info")
            return {**changes, "updated_at": self._now(), "info": merged}

        with self._errors(f"updating run {run_id!r}"):
            row = self._change_run(run_id, change)
        if row is None:
            raise StoreError(f"no run {run_id!r} in {self._where}")
        return _run(row)

    def get_run(self, run_id: str) -> RunRecord:
        rows = self._rows(f"reading run {run_id!r}", "runs", run_id=run_id)
        if not rows:
            raise StoreError(f"no run {run_id!r} in {self._where}")
        return _run(rows[0])

    def list_runs(
        self, type_id: str | None = None, identifier: str | None = None
    ) -> list[RunRecord]:
        """Oldest first."""
        rows = self._rows("listing runs", "runs", **_given(type_id=type_id, identifier=identifier))
        return [_run(r) for r in rows]

    def remove_run(self, run_id: str) -> None:
        """With its metrics and checkpoint records (not their artifacts); a missing run: no-op."""
        with self._errors(f"removing run {run_id!r}"):
            self._delete(["checkpoints", "metrics", "runs"], run_id=run_id)

    def log_metrics(self, run_id: str, step: int, values: dict[str, float]) -> None:
        """A metric the step already has is replaced: a step redone after a resume counts once."""
        try:
            numbers = {str(k): float(v) for k, v in values.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise StoreError(
                f"metric values must be a dict of numbers, got {values!r}: {exc}"
            ) from None
        what = f"run {run_id!r} metrics"

        def without_these(row: Row) -> str | None:
            old = loads(row["values"], f"metrics of run {run_id!r}")
            kept = {k: v for k, v in old.items() if k not in numbers}
            return dumps(kept, what) if kept else None

        row = {"run_id": run_id, "step": int(step), "values": dumps(numbers, what)}
        with self._errors(f"logging metrics of run {run_id!r}"):
            self._insert_metrics({**row, "created_at": self._now()}, without_these)

    def get_metrics(self, run_id: str) -> list[MetricRecord]:
        """Ordered by step, then insertion."""
        rows = self._rows(f"reading metrics of run {run_id!r}", "metrics", run_id=run_id)
        return [_record(MetricRecord, r, "values", f"metrics of run {run_id!r}") for r in rows]

    def add_checkpoint(
        self, run_id: str, step: int, artifact_id: str, info: dict[str, Any]
    ) -> CheckpointRecord:
        now = self._now()
        record = CheckpointRecord(
            run_id=run_id, step=step, artifact_id=artifact_id, created_at=now, info=dict(info)
        )
        taken = f"run {run_id!r} already has a checkpoint at step {step}"
        return self._add("checkpoints", record, f"checkpoint {step} of run {run_id!r}", taken)

    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """Oldest step first."""
        rows = self._rows(f"listing checkpoints of run {run_id!r}", "checkpoints", run_id=run_id)
        what = f"checkpoint info of run {run_id!r}"
        return [_record(CheckpointRecord, r, "info", what) for r in rows]

    def remove_checkpoint(self, run_id: str, step: int) -> None:
        """Removing one that is not there is a no-op (retention may run twice)."""
        with self._errors(f"removing checkpoint {step} of run {run_id!r}"):
            self._delete(["checkpoints"], run_id=run_id, step=step)

    def close(self) -> None:
        """Release connections; the store reopens lazily if used again."""

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """A driver error as one StoreError line; a database or login refused: ConfigError."""
        try:
            yield
        except self._driver_errors as exc:
            from llmtrain.db.sql_errors import refusal

            if (refused := refusal(exc, self._where)) is not None:
                raise refused from None
            detail = getattr(exc, "orig", None) or exc
            raise StoreError(
                f"metadata store {self._where}: {what} failed: {type(detail).__name__}: {detail}"
            ) from exc

    def _add(self, table: str, record: Info, what: str, taken: str) -> Info:
        """Insert ``record``, its info as JSON; StoreError ``taken`` if its unique key is taken."""
        row = {**record.model_dump(exclude={"info"}), "info": dumps(record.info, f"{what} info")}
        try:
            with self._errors(f"adding {what}"):
                self._insert(table, row)
        except Conflict:
            raise StoreError(taken) from None
        return record

    def _rows(self, doing: str, table: str, newest: bool = False, **equal: Any) -> list[Row]:
        with self._errors(doing):
            return self._find(table, newest, **equal)

    def _now(self) -> datetime:
        return datetime.now(UTC)

    # -- backend primitives: rows carry the record's fields, payload/info/values as JSON text --
    def _insert_component(self, row: Row, same: Callable[[Row], bool]) -> int:
        """Insert as newest + 1 (or 0), Conflict if taken; the newest's version if ``same``."""
        found = self._find("components", True, type_id=row["type_id"], identifier=row["identifier"])
        if found and same(found[0]):
            return int(found[0]["version"])
        version = int(found[0]["version"]) + 1 if found else 0
        self._insert("components", {**row, "version": version})
        return version

    @abstractmethod
    def _find(self, table: str, newest: bool = False, **equal: Any) -> list[Row]:
        """Rows whose columns equal ``equal`` (None too), in the table's order; ``newest``: last."""

    @abstractmethod
    def _delete(self, tables: list[str], **equal: Any) -> int:
        """Remove the matching rows of ``tables``, in one transaction where there are any."""

    @abstractmethod
    def _insert(self, table: str, row: Row) -> None:
        """Insert a row; Conflict if a unique key is taken."""

    @abstractmethod
    def _change_run(self, run_id: str, change: Callable[[Row], dict[str, Any]]) -> Row | None:
        """Set ``change(stored row)`` atomically, none lost to a race; the new row (or None)."""

    @abstractmethod
    def _insert_metrics(self, row: Row, without_these: Callable[[Row], str | None]) -> None:
        """In one write: old rows of the step get ``without_these`` (None: gone), then ``row``."""


def _given(**filters: Any) -> dict[str, Any]:
    """The arguments that are not None (as filters: None is any value)."""
    return {k: v for k, v in filters.items() if v is not None}


def dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{what} is not JSON-serialisable: {exc}") from None


def loads(value: Any, what: str) -> Any:
    """Stored JSON text back; anything else (bytes, a pickle) is a StoreError, never decoded."""
    try:
        if isinstance(value, str):
            return json.loads(value)
        problem = f"not JSON text but {type(value).__name__}"
    except ValueError as exc:
        problem = f"not valid JSON ({exc})"
    raise StoreError(f"{what} is {problem}; was it edited outside llmtrain?") from None


def pause(attempt: int) -> None:
    """A short random sleep, so racing writers do not collide again in lockstep."""
    time.sleep(random.uniform(0.001, 0.005 * min(attempt + 1, 10)))


def _record(cls: type[R], row: Row, field: str, what: str) -> R:
    """``field`` decoded from JSON, times as aware UTC (drivers hand back naive or aware)."""
    data = {name: row.get(name) for name in cls.model_fields}
    data[field] = loads(row.get(field), what)
    for name in ("created_at", "updated_at"):
        if isinstance(value := data.get(name), datetime):
            data[name] = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return cls(**data)


def _component(row: Row) -> ComponentRecord:
    type_id, identifier, version = (row.get(k) for k in ("type_id", "identifier", "version"))
    what = f"stored component {type_id!r} {identifier!r} v{version!r}"
    try:
        return _record(ComponentRecord, row, "payload", f"{what}: its payload")
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise StoreError(
            f"{what} is not a valid record ({problems}); was it edited outside llmtrain?"
        ) from None


def _run(row: Row) -> RunRecord:
    return _record(RunRecord, row, "info", f"info of run {row['run_id']!r}")
