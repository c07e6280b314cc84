"""SQL backend (SQLAlchemy Core): keyset pages on a unique, ordered key.

Names reach SQL only as quoted identifiers built by SQLAlchemy; values only as bound
parameters. Each call checks out a connection, runs one SELECT and returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from llmtrain.backends.base import DataBackend, Key, KeyScan, Row
from llmtrain.backends.engines import dispose_sql_engine, sql_engine
from llmtrain.backends.retry import RetryPolicy, with_retry
from llmtrain.errors import QueryError
from llmtrain.queries import Query, RawSQL, Table
from llmtrain.uri import redact_uri

_IN_CHUNK = 1000


class _Source:
    """A query turned into SQLAlchemy objects: the key column, field columns and filter."""

    def __init__(self, key: sa.ColumnElement[Any], columns: dict[str, sa.ColumnElement[Any]],
                 where: sa.ColumnElement[bool] | None, source: str) -> None:
        self.key, self.columns, self.where, self.source = key, columns, where, source

    def column(self, field: str) -> sa.ColumnElement[Any]:
        try:
            return self.columns[field]
        except KeyError:
            raise QueryError(f"{self.source} has no column {field!r}; "
                             f"columns: {sorted(self.columns)}") from None

    def select(self, *cols: sa.ColumnElement[Any]) -> sa.Select[Any]:
        stmt = sa.select(*cols)
        return stmt.where(self.where) if self.where is not None else stmt


class SQLBackend(DataBackend):
    def __init__(self, uri: str, *, retry: RetryPolicy | None = None) -> None:
        self._uri = uri
        self.uri = redact_uri(uri)
        self.retry = retry or RetryPolicy()
        self._sources: dict[str, _Source] = {}

    # -- plumbing -------------------------------------------------------------------------
    @property
    def engine(self) -> sa.Engine:
        return sql_engine(self._uri)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sources": {}}

    def close(self) -> None:
        dispose_sql_engine(self._uri)
        self._sources.clear()

    def reconnect(self) -> None:
        self.close()

    def _run(self, what: str, stmt: sa.Executable, params: dict[str, Any] | None = None
             ) -> list[Any]:
        def call() -> list[Any]:
            with self.engine.connect() as conn:
                return list(conn.execute(stmt, params or {}).all())

        return with_retry(call, policy=self.retry, transient=(sa.exc.OperationalError,
                                                               sa.exc.InterfaceError),
                          reconnect=self.reconnect, what=what, where=self.uri)

    def _source(self, query: Query) -> _Source:
        cached = self._sources.get(query.fingerprint())
        if cached is None:
            cached = self._sources[query.fingerprint()] = self._build(query)
        return cached

    def _build(self, query: Query) -> _Source:
        if isinstance(query, Table):
            return self._build_table(query)
        if isinstance(query, RawSQL):
            return self._build_raw(query)
        raise QueryError(f"{type(query).__name__} cannot run on SQL database {self.uri}")

    def _build_table(self, query: Table) -> _Source:
        try:
            table = with_retry(
                lambda: sa.Table(query.name, sa.MetaData(), schema=query.schema,
                                 autoload_with=self.engine),
                policy=self.retry, transient=(sa.exc.OperationalError,),
                reconnect=self.reconnect, what="reading the table schema", where=self.uri)
        except sa.exc.NoSuchTableError:
            raise QueryError(f"{query.source} does not exist in {self.uri}") from None
        if query.key is not None:
            if query.key not in table.c:
                raise QueryError(f"{query.source} has no key column {query.key!r}")
            key = table.c[query.key]
        else:
            pk = list(table.primary_key.columns)
            if len(pk) != 1:
                raise QueryError(
                    f"{query.source} has {'a composite' if pk else 'no'} primary key, so rows "
                    "cannot be paged in a stable order; pass Table(..., key='column') naming a "
                    "unique, non-null column")
            key = pk[0]
        names = query.columns or tuple(c.name for c in table.c)
        columns = {}
        for name in names:
            if name not in table.c:
                raise QueryError(f"{query.source} has no column {name!r}; "
                                 f"columns: {[c.name for c in table.c]}")
            columns[name] = table.c[name]
        where = sa.text(query.where_sql).bindparams(**query.params) if query.where_sql else None
        return _Source(key, columns, where, query.source)

    def _build_raw(self, query: RawSQL) -> _Source:
        text = sa.text(query.text).bindparams(**query.params)
        probe = with_retry(
            lambda: self._probe_columns(text), policy=self.retry,
            transient=(sa.exc.OperationalError,), reconnect=self.reconnect,
            what="reading the query's columns", where=self.uri)
        if query.key not in probe:
            raise QueryError(f"{query.source}: key column {query.key!r} is not in its result "
                             f"columns {probe}")
        sub = text.columns(*[sa.column(c) for c in probe]).subquery("llmtrain_q")
        return _Source(sub.c[query.key], {c: sub.c[c] for c in probe}, None, query.source)

    def _probe_columns(self, text: sa.TextClause) -> list[str]:
        sub = text.columns().subquery("llmtrain_probe")
        with self.engine.connect() as conn:
            result = conn.execute(sa.select(sa.literal_column("*")).select_from(sub).limit(0))
            return list(result.keys())

    # -- DataBackend ------------------------------------------------------------------------
    def key_name(self, query: Query) -> str:
        return self._source(query).key.name

    def scan_keys(self, query: Query, block_size: int) -> KeyScan:
        src = self._source(query)
        totals = self._run("counting rows", src.select(sa.func.count(), sa.func.max(src.key)))
        count, last = totals[0]
        if not count:
            return KeyScan(0, block_size, [], None)
        numbered = src.select(
            src.key.label("k"), sa.func.row_number().over(order_by=src.key).label("rn")
        ).subquery("llmtrain_numbered")
        stmt = (sa.select(numbered.c.k).where((numbered.c.rn - 1) % block_size == 0)
                .order_by(numbered.c.k))
        boundaries = [r[0] for r in self._run("scanning keys", stmt)]
        return KeyScan(int(count), block_size, boundaries, last)

    def key_at(self, query: Query, lower: Key, offset: int) -> Key:
        src = self._source(query)
        stmt = (src.select(src.key).where(src.key >= lower).order_by(src.key)
                .limit(1).offset(offset))
        rows = self._run("locating a key", stmt)
        if not rows:
            raise QueryError(f"{query.source}: fewer rows than expected after key {lower!r}; "
                             "the rows changed while reading")
        return rows[0][0]

    def fetch_rows(self, query: Query, fields: Sequence[str], lower: Key | None, limit: int,
                   *, inclusive: bool = True) -> list[tuple[Key, Row]]:
        src = self._source(query)
        stmt = src.select(src.key, *[src.column(f) for f in fields])
        if lower is not None:
            stmt = stmt.where(src.key >= lower if inclusive else src.key > lower)
        rows = self._run("reading rows", stmt.order_by(src.key).limit(limit))
        names = list(fields)
        return [(r[0], dict(zip(names, r[1:]))) for r in rows]

    def fetch_keys(self, query: Query, lower: Key, limit: int) -> list[Key]:
        src = self._source(query)
        stmt = src.select(src.key).where(src.key >= lower).order_by(src.key).limit(limit)
        return [r[0] for r in self._run("reading keys", stmt)]

    def fetch_by_keys(self, query: Query, fields: Sequence[str],
                      keys: Sequence[Key]) -> list[tuple[Key, Row]]:
        src = self._source(query)
        cols = [src.column(f) for f in fields]
        names = list(fields)
        out: list[tuple[Key, Row]] = []
        for i in range(0, len(keys), _IN_CHUNK):
            stmt = src.select(src.key, *cols).where(src.key.in_(list(keys[i:i + _IN_CHUNK])))
            out.extend((r[0], dict(zip(names, r[1:]))) for r in self._run("reading rows", stmt))
        return out
