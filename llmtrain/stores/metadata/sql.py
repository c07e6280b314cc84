"""The metadata store on any SQLAlchemy database: four ``_llmtrain_*`` tables made by the first
write, JSON as text, strings binary-collated on MySQL (``"Foo"`` and ``"foo"`` stay distinct)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from llmtrain.db.engines import dispose_sql_engine, sql_engine, sqlite_path
from llmtrain.db.sql_errors import is_lock_conflict
from llmtrain.errors import StoreError
from llmtrain.stores.metadata.base import TABLE_PREFIX, UTC, Conflict, MetadataStore, Row, pause

T = TypeVar("T")
LOCK_TRIES = 5  # tries of a transaction that hit a deadlock or lock timeout


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Naive UTC in the database (portable); read back naive, made aware by ``_record``."""

    # MySQL's plain DATETIME drops the microseconds
    impl = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value


_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER only
_JSON = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")  # TEXT caps at 64 KiB there
# The mariadb:// dialect reads only mariadb_* options, mysql:// only mysql_* ones.
_TABLE_KW: dict[str, Any] = {
    f"{dialect}_{option}": value
    for dialect in ("mysql", "mariadb")
    for option, value in (("engine", "InnoDB"), ("charset", "utf8mb4"), ("collate", "utf8mb4_bin"))
}

schema = sa.MetaData()


def _table(name: str, *items: sa.schema.SchemaItem) -> sa.Table:
    return sa.Table(f"{TABLE_PREFIX}{name}", schema, *items, **_TABLE_KW)


components = _table(
    "components",
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("type_id", sa.String(128), nullable=False),
    sa.Column("identifier", sa.String(255), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("payload", _JSON, nullable=False),
    # Inside CREATE TABLE (not a separate index) so no process ever sees the table without it.
    sa.UniqueConstraint(
        "type_id", "identifier", "version", name=f"uq_{TABLE_PREFIX}components_version"
    ),
)
runs = _table(
    "runs",
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
)
metrics = _table(
    "metrics",
    sa.Column("id", _ID, primary_key=True, autoincrement=True),  # insertion order
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("metric_values", _JSON, nullable=False, key="values"),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Index(f"ix_{TABLE_PREFIX}metrics_run_step", "run_id", "step"),
)
checkpoints = _table(
    "checkpoints",
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("artifact_id", sa.String(128), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("info", _JSON, nullable=False),
    sa.UniqueConstraint("run_id", "step", name=f"uq_{TABLE_PREFIX}checkpoints_step"),
)


def ddl_schema(dialect: sa.Dialect) -> sa.MetaData:
    """The tables as created: on MySQL/MariaDB with a binary collation that does not pad
    (``utf8mb4_bin`` compares ``"a "`` equal to ``"a"``, so unique keys would merge them)."""
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


class SQLMetadataStore(MetadataStore):
    """A read without the tables finds nothing; of a missing SQLite file raises (not missing_ok)."""

    _driver_errors = (sa.exc.SQLAlchemyError,)
    _schema_ready = False

    def _create_schema(self, engine: sa.Engine) -> None:
        """``checkfirst`` can race with another thread or process creating a table: retry."""
        for attempt in range(10):
            try:
                with engine.begin() as conn:  # connected: the server version is known
                    ddl_schema(conn.dialect).create_all(conn, checkfirst=True)
                self._schema_ready = True
                return
            except sa.exc.DBAPIError as exc:
                if attempt == 9:
                    raise StoreError(
                        f"metadata store {self._where}: cannot create the "
                        f"{TABLE_PREFIX}* tables: {exc.orig}"
                    ) from exc
                pause(attempt)

    def _has_tables(self, conn: sa.Connection) -> bool:
        if not self._schema_ready and sa.inspect(conn).has_table(components.name):
            self._schema_ready = True  # another store or process created them
        return self._schema_ready

    def _absent(self) -> bool:
        """A SQLite file that is not there and may not be yet (``missing_ok``)."""
        path = sqlite_path(self._uri) if self._missing_ok else None
        return path is not None and not path.exists()

    def _write(
        self, fn: Callable[[sa.Connection], T], *, creates: bool = True, empty: T | None = None
    ) -> T | None:
        """``fn`` in one transaction: a unique key taken is a Conflict, a lock conflict retried.
        A write that only deletes or updates (``creates=False``) creates no tables: ``empty``."""
        if not creates and self._absent():
            return empty
        engine = sql_engine(self._uri, create=creates)
        if not self._schema_ready and creates:
            self._create_schema(engine)
        elif not self._schema_ready:
            with engine.connect() as conn:
                if not self._has_tables(conn):
                    return empty
        lock_failures = 0
        while True:
            try:
                with engine.connect() as conn:
                    if engine.dialect.name == "sqlite":
                        # lock first: a deferred transaction that read cannot wait for it, it fails
                        conn.exec_driver_sql("BEGIN IMMEDIATE")
                    result = fn(conn)
                    conn.commit()
                    return result
            except sa.exc.IntegrityError as exc:
                raise Conflict(str(exc.orig)) from exc
            except sa.exc.DBAPIError as exc:
                # SQLite reports "locked" only after its 60 s busy timeout: few retries.
                lock_failures += 1
                if not is_lock_conflict(exc) or lock_failures >= LOCK_TRIES:
                    raise
                pause(lock_failures)

    def _find(self, table: str, newest: bool = False, **equal: Any) -> list[Row]:
        if self._absent():
            return []
        with sql_engine(self._uri).connect() as conn:  # no tables yet: none are created
            return _rows(conn, _select(table, newest, equal)) if self._has_tables(conn) else []

    def _delete(self, tables: list[str], **equal: Any) -> int:
        def delete(conn: sa.Connection) -> int:
            found = 0
            for name in tables:
                table = schema.tables[TABLE_PREFIX + name]
                where = [table.c[k] == v for k, v in equal.items()]
                found += conn.execute(table.delete().where(*where)).rowcount
            return found

        return int(self._write(delete, creates=False, empty=0) or 0)

    def _insert(self, table: str, row: Row) -> None:
        insert = schema.tables[TABLE_PREFIX + table].insert().values(**row)
        self._write(lambda conn: conn.execute(insert))

    def _insert_component(self, row: Row, same: Callable[[Row], bool]) -> int:
        query = _select("components", True, {k: row[k] for k in ("type_id", "identifier")})

        def insert(conn: sa.Connection) -> int:
            newest = next(iter(_rows(conn, query)), None)
            if newest is not None and same(newest):
                return int(newest["version"])
            version = 0 if newest is None else int(newest["version"]) + 1
            conn.execute(components.insert().values(**row, version=version))
            return version

        return int(self._write(insert) or 0)

    def _change_run(self, run_id: str, change: Callable[[Row], dict[str, Any]]) -> Row | None:
        def update(conn: sa.Connection) -> Row | None:
            query = _select("runs", False, {"run_id": run_id}).with_for_update()
            found = next(iter(_rows(conn, query)), None)
            if found is None:
                return None
            changes = change(found)
            conn.execute(runs.update().where(runs.c.run_id == run_id).values(**changes))
            return {**found, **changes}

        return self._write(update, creates=False)

    def _insert_metrics(self, row: Row, without_these: Callable[[Row], str | None]) -> None:
        same_step = _select("metrics", False, {"run_id": row["run_id"], "step": row["step"]})

        def replace(conn: sa.Connection) -> None:
            for old in _rows(conn, same_step.with_for_update()):
                kept, where = without_these(old), metrics.c.id == old["id"]
                if kept is None:
                    conn.execute(metrics.delete().where(where))
                elif kept != old["values"]:
                    conn.execute(metrics.update().where(where).values(values=kept))
            conn.execute(metrics.insert().values(**row))

        self._write(replace)

    def close(self) -> None:
        dispose_sql_engine(self._uri)


_ORDER = dict(components=("version",), runs=("seq",), metrics=("step", "id"), checkpoints=("step",))


def _rows(conn: sa.Connection, query: sa.Select[Any]) -> list[Row]:
    return [dict(r) for r in conn.execute(query).mappings()]


def _select(name: str, newest: bool, equal: Mapping[str, Any]) -> sa.Select[Any]:
    """As ``_find`` says, each column under its key (``metric_values`` as ``values``)."""
    table = schema.tables[TABLE_PREFIX + name]
    order = [table.c[k] for k in _ORDER[name]]
    where = [table.c[k] == v for k, v in equal.items()]  # IS NULL for None
    query = sa.select(*(c.label(c.key) for c in table.c)).where(*where)
    if newest:
        return query.order_by(*(c.desc() for c in order)).limit(1)
    return query.order_by(*order)
