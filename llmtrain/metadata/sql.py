"""The metadata store on any SQLAlchemy database (SQLite, PostgreSQL, MySQL/MariaDB).

Core only, four ``_llmtrain_*`` tables created on first use; user tables are never touched.
JSON goes in TEXT columns (LONGTEXT on MySQL) so every backend stores the same thing, and
string columns are binary-collated on MySQL so ``"Foo"`` and ``"foo"`` stay distinct there too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from llmtrain.backends.engines import dispose_sql_engine, sql_engine
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
    now_utc,
    pause,
)

T = TypeVar("T")
#: deadlocks and lock timeouts are retried this many times
LOCK_TRIES = 5


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Naive UTC in the database (portable), timezone-aware UTC in Python."""

    impl = sa.DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):  # plain DATETIME drops the microseconds
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(sa.DateTime())

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None,
                             dialect: sa.Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER only
_JSON = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")  # TEXT caps at 64 KiB there
# The mariadb:// dialect reads only mariadb_* options, mysql:// only mysql_* ones.
_TABLE_KW = {f"{prefix}_{option}": value for prefix in ("mysql", "mariadb") for option, value in
             {"engine": "InnoDB", "charset": "utf8mb4", "collate": "utf8mb4_bin"}.items()}

schema = sa.MetaData()
components = sa.Table(
    f"{TABLE_PREFIX}components", schema,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("type_id", sa.String(128), nullable=False),
    sa.Column("identifier", sa.String(255), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("payload", _JSON, nullable=False),
    # Inside CREATE TABLE (not a separate index) so no process ever sees the table without it.
    sa.UniqueConstraint("type_id", "identifier", "version",
                        name=f"uq_{TABLE_PREFIX}components_version"),
    **_TABLE_KW,
)
runs = sa.Table(
    f"{TABLE_PREFIX}runs", schema,
    sa.Column("seq", _ID, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("type_id", sa.String(128), nullable=False),
    sa.Column("identifier", sa.String(255), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("info", _JSON, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.UniqueConstraint("run_id", name=f"uq_{TABLE_PREFIX}runs_run_id"),
    **_TABLE_KW,
)
metrics = sa.Table(
    f"{TABLE_PREFIX}metrics", schema,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),  # insertion order
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("metric_values", _JSON, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Index(f"ix_{TABLE_PREFIX}metrics_run_step", "run_id", "step"),
    **_TABLE_KW,
)
checkpoints = sa.Table(
    f"{TABLE_PREFIX}checkpoints", schema,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("artifact_id", sa.String(128), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("info", _JSON, nullable=False),
    sa.UniqueConstraint("run_id", "step", name=f"uq_{TABLE_PREFIX}checkpoints_step"),
    **_TABLE_KW,
)


def ddl_schema(dialect: sa.Dialect) -> sa.MetaData:
    """The tables as created: on MySQL/MariaDB with a binary collation that does not pad.

    ``utf8mb4_bin`` compares ``"a "`` equal to ``"a"`` (PAD SPACE), so the unique keys would
    merge them; MariaDB has ``utf8mb4_nopad_bin``, MySQL 8.0.17+ ``utf8mb4_0900_bin``.
    """
    if dialect.name not in ("mysql", "mariadb"):
        return schema
    version = dialect.server_version_info or (0,)
    if getattr(dialect, "is_mariadb", False):
        collation = "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
    else:
        collation = "utf8mb4_0900_bin" if version >= (8, 0, 17) else "utf8mb4_bin"
    ddl = sa.MetaData()
    for table in schema.sorted_tables:
        copy = table.to_metadata(ddl)
        copy.dialect_kwargs["mysql_collate"] = copy.dialect_kwargs["mariadb_collate"] = collation
    return ddl


def _is_transient(exc: sa.exc.DBAPIError) -> bool:
    """Lock conflicts that a fresh transaction resolves (deadlock, busy SQLite file)."""
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in {"40001", "40P01"}:  # PostgreSQL
        return True
    code = orig.args[0] if orig is not None and orig.args else None
    if code in (1205, 1213):  # MySQL lock wait timeout, deadlock
        return True
    return "database is locked" in str(orig)  # SQLite


class SQLMetadataStore(MetadataStore):
    """Components and runs in ``_llmtrain_*`` tables of a SQL database.

    The engine comes from :func:`sql_engine` on every call (shared with the data backend,
    one per process), so the store pickles as its URI and reopens lazily.
    """

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self._schema_ready = False
        self._schema_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except sa.exc.SQLAlchemyError as exc:
            detail = getattr(exc, "orig", None) or exc
            raise StoreError(f"metadata store {self._where}: {what} failed: "
                             f"{type(detail).__name__}: {detail}") from exc

    def _engine(self) -> sa.Engine:
        engine = sql_engine(self._uri)
        if not self._schema_ready:
            with self._schema_lock:
                if not self._schema_ready:
                    self._create_schema(engine)
                    self._schema_ready = True
        return engine

    def _create_schema(self, engine: sa.Engine) -> None:
        """``checkfirst`` can race with another process creating the same table: retry."""
        for attempt in range(10):
            try:
                with engine.begin() as conn:  # connected: the server version is known
                    ddl_schema(conn.dialect).create_all(conn, checkfirst=True)
                return
            except sa.exc.DBAPIError as exc:
                if attempt == 9:
                    raise StoreError(f"metadata store {self._where}: cannot create the "
                                     f"{TABLE_PREFIX}* tables: {exc.orig}") from exc
                pause(attempt)

    def _read(self, what: str, fn: Callable[[sa.Connection], T]) -> T:
        with self._errors(what):
            engine = self._engine()
            with engine.connect() as conn:
                return fn(conn)

    def _write(self, what: str, fn: Callable[[sa.Connection], T], *,
               retry_conflicts: bool = False) -> T:
        """Run ``fn`` in one transaction. Retry a lost race on a unique key when asked
        (another writer took the same version first) and, a few times, a lock conflict."""
        with self._errors(what):
            engine = self._engine()
            conflicts = lock_failures = 0
            while True:
                try:
                    with engine.connect() as conn:
                        if engine.dialect.name == "sqlite":
                            # Take the write lock up front: a deferred transaction that read
                            # first cannot wait for the lock, it fails at once.
                            conn.exec_driver_sql("BEGIN IMMEDIATE")
                        result = fn(conn)
                        conn.commit()
                        return result
                except sa.exc.IntegrityError:
                    conflicts += 1
                    if not retry_conflicts or conflicts >= MAX_TRIES:
                        raise
                    pause(conflicts)
                except sa.exc.DBAPIError as exc:
                    # SQLite reports "locked" only after its 60 s busy timeout: few retries.
                    lock_failures += 1
                    if not _is_transient(exc) or lock_failures >= LOCK_TRIES:
                        raise
                    pause(lock_failures)

    # -- components ---------------------------------------------------------------------------
    def add_component(self, type_id: str, identifier: str, payload: dict[str, Any]) -> int:
        if not isinstance(payload, dict):
            raise StoreError(f"{type_id} {identifier!r}: payload must be a dict, "
                             f"got {type(payload).__name__}")
        text = dumps(payload, f"{type_id} {identifier!r} payload")
        c = components.c

        def insert(conn: sa.Connection) -> int:
            newest = conn.execute(sa.select(sa.func.max(c.version)).where(
                c.type_id == type_id, c.identifier == identifier)).scalar()
            version = 0 if newest is None else int(newest) + 1
            conn.execute(components.insert().values(
                type_id=type_id, identifier=identifier, version=version,
                created_at=now_utc(), payload=text))
            return version

        return self._write(f"adding {type_id} {identifier!r}", insert, retry_conflicts=True)

    def get_component(self, type_id: str, identifier: str,
                      version: int | None = None) -> ComponentRecord:
        c = components.c
        query = sa.select(components).where(c.type_id == type_id, c.identifier == identifier)
        if version is None:
            query = query.order_by(c.version.desc()).limit(1)
        else:
            query = query.where(c.version == version)
        row = self._read(f"reading {type_id} {identifier!r}",
                         lambda conn: conn.execute(query).mappings().first())
        if row is None:
            which = "any version" if version is None else f"version {version}"
            raise ComponentNotFoundError(
                f"no {type_id} {identifier!r} ({which}) in {self._where}")
        return _component(row)

    def list_components(self, type_id: str | None = None,
                        identifier: str | None = None) -> list[ComponentRecord]:
        c = components.c
        query = sa.select(components)
        if type_id is not None:
            query = query.where(c.type_id == type_id)
        if identifier is not None:
            query = query.where(c.identifier == identifier)
        rows = self._read("listing components",
                          lambda conn: conn.execute(query).mappings().all())
        # Sorted here: collations differ between databases, code points do not.
        records = [_component(r) for r in rows]
        return sorted(records, key=lambda r: (r.type_id, r.identifier, r.version))

    def remove_component(self, type_id: str, identifier: str, version: int | None = None) -> int:
        c = components.c
        stmt = components.delete().where(c.type_id == type_id, c.identifier == identifier)
        if version is not None:
            stmt = stmt.where(c.version == version)
        return self._write(f"removing {type_id} {identifier!r}",
                           lambda conn: conn.execute(stmt).rowcount)

    # -- runs ---------------------------------------------------------------------------------
    def create_run(self, run_id: str, type_id: str, identifier: str, version: int,
                   info: dict[str, Any]) -> RunRecord:
        now = now_utc()
        record = RunRecord(run_id=run_id, type_id=type_id, identifier=identifier,
                           version=version, status="created", created_at=now, updated_at=now,
                           info=dict(info))
        text = dumps(record.info, f"run {run_id!r} info")
        try:
            self._write(f"creating run {run_id!r}", lambda conn: conn.execute(
                runs.insert().values(**record.model_dump(exclude={"info"}), info=text)))
        except StoreError as exc:
            if isinstance(exc.__cause__, sa.exc.IntegrityError):
                raise StoreError(f"run {run_id!r} already exists in {self._where}") from None
            raise
        return record

    def update_run(self, run_id: str, *, status: RunStatus | None = None,
                   info: dict[str, Any] | None = None, error: str | None = None) -> RunRecord:
        if status is not None:
            check_status(status)

        def update(conn: sa.Connection) -> RunRecord:
            row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)
                               .with_for_update()).mappings().first()
            if row is None:
                raise StoreError(f"no run {run_id!r} in {self._where}")
            record = _run(row)
            changes: dict[str, Any] = {"updated_at": now_utc()}
            if status is not None:
                changes["status"] = status
            if error is not None:
                changes["error"] = error
            elif status in ("running", "completed"):
                changes["error"] = None  # a run going again, or done, carries no old failure
            merged = {**record.info, **(info or {})}
            changes["info"] = dumps(merged, f"run {run_id!r} info")
            conn.execute(runs.update().where(runs.c.run_id == run_id).values(**changes))
            return record.model_copy(update={**changes, "info": merged})

        return self._write(f"updating run {run_id!r}", update)

    def get_run(self, run_id: str) -> RunRecord:
        row = self._read(f"reading run {run_id!r}", lambda conn: conn.execute(
            sa.select(runs).where(runs.c.run_id == run_id)).mappings().first())
        if row is None:
            raise StoreError(f"no run {run_id!r} in {self._where}")
        return _run(row)

    def list_runs(self, type_id: str | None = None,
                  identifier: str | None = None) -> list[RunRecord]:
        query = sa.select(runs).order_by(runs.c.seq)
        if type_id is not None:
            query = query.where(runs.c.type_id == type_id)
        if identifier is not None:
            query = query.where(runs.c.identifier == identifier)
        rows = self._read("listing runs", lambda conn: conn.execute(query).mappings().all())
        return [_run(r) for r in rows]

    # -- metrics and checkpoints ----------------------------------------------------------------
    def log_metrics(self, run_id: str, step: int, values: dict[str, float]) -> None:
        text = dumps(float_values(values), f"run {run_id!r} metrics")
        self._write(f"logging metrics of run {run_id!r}", lambda conn: conn.execute(
            metrics.insert().values(run_id=run_id, step=int(step), metric_values=text,
                                    created_at=now_utc())))

    def get_metrics(self, run_id: str) -> list[MetricRecord]:
        query = (sa.select(metrics).where(metrics.c.run_id == run_id)
                 .order_by(metrics.c.step, metrics.c.id))
        rows = self._read(f"reading metrics of run {run_id!r}",
                          lambda conn: conn.execute(query).mappings().all())
        return [MetricRecord(run_id=r["run_id"], step=r["step"],
                             values=json.loads(r["metric_values"]),
                             created_at=r["created_at"]) for r in rows]

    def add_checkpoint(self, run_id: str, step: int, artifact_id: str,
                       info: dict[str, Any]) -> CheckpointRecord:
        record = CheckpointRecord(run_id=run_id, step=step, artifact_id=artifact_id,
                                  created_at=now_utc(), info=dict(info))
        text = dumps(record.info, f"checkpoint info of run {run_id!r}")
        try:
            self._write(f"adding checkpoint {step} of run {run_id!r}", lambda conn: conn.execute(
                checkpoints.insert().values(**record.model_dump(exclude={"info"}), info=text)))
        except StoreError as exc:
            if isinstance(exc.__cause__, sa.exc.IntegrityError):
                raise StoreError(f"run {run_id!r} already has a checkpoint at step "
                                 f"{step}") from None
            raise
        return record

    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        query = (sa.select(checkpoints).where(checkpoints.c.run_id == run_id)
                 .order_by(checkpoints.c.step))
        rows = self._read(f"listing checkpoints of run {run_id!r}",
                          lambda conn: conn.execute(query).mappings().all())
        return [CheckpointRecord(run_id=r["run_id"], step=r["step"],
                                 artifact_id=r["artifact_id"], created_at=r["created_at"],
                                 info=json.loads(r["info"])) for r in rows]

    def remove_checkpoint(self, run_id: str, step: int) -> None:
        """Removing one that is not there is a no-op (retention may run twice)."""
        stmt = checkpoints.delete().where(checkpoints.c.run_id == run_id,
                                          checkpoints.c.step == step)
        self._write(f"removing checkpoint {step} of run {run_id!r}",
                    lambda conn: conn.execute(stmt))

    def close(self) -> None:
        dispose_sql_engine(self._uri)


def _component(row: sa.RowMapping) -> ComponentRecord:
    return component_record(row["type_id"], row["identifier"], row["version"],
                            row["created_at"], row["payload"])


def _run(row: sa.RowMapping) -> RunRecord:
    return RunRecord(run_id=row["run_id"], type_id=row["type_id"], identifier=row["identifier"],
                     version=row["version"], status=row["status"], created_at=row["created_at"],
                     updated_at=row["updated_at"], info=json.loads(row["info"]),
                     error=row["error"])
