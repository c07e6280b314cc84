"""SQL backend (SQLAlchemy Core): keyset pages on a unique key. Names reach SQL only quoted,
values only bound; one SELECT a call (on PostgreSQL in autocommit: no BEGIN/ROLLBACK trips)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

import numpy as np
import sqlalchemy as sa
import sqlglot
from sqlglot import exp

from llmtrain.db.backend import NO_KEY, DataBackend, Fields, KeyedRows, keyset
from llmtrain.db.engines import dispose_sql_engine, sql_engine
from llmtrain.db.forgotten import Bases, Condition, Guarded, Rewriter, guarded_tables, store_keys
from llmtrain.db.keys import Key, KeyPage, check_keys, in_sorted, key_digests
from llmtrain.db.queries import TURNS, Conversations, Query, RawSQL, Table, conversations
from llmtrain.db.retry import RetryPolicy
from llmtrain.db.sources import SQLGLOT_NAMES, Source, folded, match_name, split_name
from llmtrain.db.sql_errors import database_message, is_transient, refusal
from llmtrain.errors import ConfigError, QueryError

_LOWER, _LIMIT = "llmtrain_lower", "llmtrain_limit"
_MAX_PAGES = 256


def _python_type(column_type: Any) -> type | None:
    """The Python type a column's values come as; None where SQLAlchemy cannot say."""
    try:
        return column_type.python_type
    except NotImplementedError:
        return None


def _converts(column_type: Any, dialect: Any) -> bool:
    """Whether SQLAlchemy converts the column's driver values (a SQLite DATE's text to a date)."""
    try:
        return bool(column_type.dialect_impl(dialect).result_processor(dialect, None))
    except Exception:  # noqa: BLE001 - a processor that needs the driver's type code
        return True


def _pairs(rows: Sequence[Any], names: Sequence[str]) -> KeyedRows:
    return [(r[0], dict(zip(names, r[1:]))) for r in rows]


def _text(sql: str, params: dict[str, Any], source: str) -> sa.TextClause:
    try:
        return sa.text(sql + "\n").bindparams(**params)  # a closing -- comment ends there
    except sa.exc.ArgumentError as exc:  # e.g. a parameter the text does not use
        raise QueryError(f"{source}: {exc}") from None


def key_table(text: str, key: str, dialect: str) -> tuple[str, str, str]:
    """(schema, table, column) a SELECT's ``key`` comes from: a bare column of its only table or of
    the one its qualifier names (alias first), as the catalog spells them (:func:`folded`); else
    (computed, UNION) a QueryError: pass source=."""
    ask = "name it with lt.sql(..., source='table'), so forget and lineage know whose keys they are"
    try:
        tree = sqlglot.parse_one(text, read=SQLGLOT_NAMES.get(dialect))
    except sqlglot.errors.ParseError as exc:
        what = f"sql(): cannot tell which table key {key!r} comes from ({exc}); {ask}"
        raise QueryError(what) from None

    def named(node: Any, part: str) -> str:
        ident = node.args.get(part)
        return "" if ident is None else folded(ident, dialect)

    # only the outermost FROM and JOINs: a subquery, CTE or UNION may rename any column to the key
    outer = [tree.args.get("from_"), *tree.args.get("joins", [])]
    read = [part.this for part in outer if part is not None] if isinstance(tree, exp.Select) else []
    ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
    plain = all(  # else (a subquery, a CTE, a table function) no table is traced
        isinstance(t, exp.Table)
        and isinstance(t.this, exp.Identifier)
        and (t.args.get("db") or t.name not in ctes)
        for t in read
    )
    tables = [(named(t, "db"), named(t, "this"), t.alias_or_name) for t in read] if plain else []

    def output(e: Any) -> str:
        part = "alias" if isinstance(e, exp.Alias) else "this"
        return named(e, part) if isinstance(e, exp.Alias | exp.Column) else e.alias_or_name

    projected = {output(e): e.unalias() for e in getattr(tree, "expressions", [])}
    found = projected.get(key)
    bare = isinstance(found, exp.Column) or (found is None and "*" in projected)
    column = named(found, "this") if isinstance(found, exp.Column) else key
    if bare and len({(s, t) for s, t, _ in tables}) == 1:  # a Select: others were refused
        return tables[0][0], tables[0][1], column
    if bare and isinstance(found, exp.Column) and found.table:
        qualifier = named(found, "table")
        for match in (lambda a, t: a == found.table, lambda a, t: t == qualifier):
            hits = {(s, t) for s, t, a in tables if match(a, t)}
            if len(hits) == 1:
                return (*hits.pop(), column)
    names = sorted({t.name for t in tree.find_all(exp.Table)})
    raise QueryError(f"sql(): key {key!r} cannot be traced to one of the tables {names}; {ask}")


@dataclass(frozen=True)
class _Source:
    """A query turned into SQLAlchemy objects: the key column, field columns and filter."""

    key: sa.ColumnElement[Any]
    columns: Mapping[str, sa.ColumnElement[Any]]
    where: sa.TextClause | None
    source: str

    def column(self, field: str) -> sa.ColumnElement[Any]:
        if field not in self.columns:
            raise QueryError(
                f"{self.source} has no column {field!r}; columns: {sorted(self.columns)}"
            )
        return self.columns[field]

    def select(self, *cols: sa.ColumnElement[Any]) -> sa.Select[Any]:
        stmt = sa.select(*cols)
        return stmt.where(self.where) if self.where is not None else stmt


@contextmanager
def _read_only(conn: sa.Connection, timeout_s: float) -> Iterator[None]:
    """A transaction that cannot write and stops after ``timeout_s``; rolled back."""
    dialect, raw = conn.dialect.name, conn.connection.dbapi_connection
    tx = conn.begin()  # no statement yet: the first SET still shapes the transaction
    if dialect == "postgresql":
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
    elif dialect == "sqlite":
        conn.exec_driver_sql("PRAGMA query_only = 1")
        end = time.monotonic() + timeout_s
        raw.set_progress_handler(lambda: time.monotonic() > end, 10_000)  # type: ignore[union-attr]
    else:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        conn.exec_driver_sql(f"SET SESSION max_statement_time = {timeout_s}")
    try:
        yield
    finally:
        if dialect == "sqlite":
            raw.set_progress_handler(None, 0)  # type: ignore[union-attr]
            conn.exec_driver_sql("PRAGMA query_only = 0")
        elif dialect != "postgresql":
            conn.exec_driver_sql("SET SESSION max_statement_time = 0")
        tx.rollback()


class SQLBackend(DataBackend):
    def __init__(self, uri: str, *, retry: RetryPolicy | None = None) -> None:
        super().__init__(uri, retry=retry)
        self._sources: dict[str, _Source] = {}
        self._pages: dict[tuple[Any, ...], sa.Select[Any]] = {}
        self._guarded: list[Guarded] | None = None  # tables with forgotten rows, when built
        self._rewards: dict[str, sa.TextClause] = {}  # sql_reward statements, as run

    @property
    def engine(self) -> sa.Engine:
        return sql_engine(self._uri)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sources": {}, "_pages": {}, "_rewards": {}, "_guarded": None}

    def close(self) -> None:
        dispose_sql_engine(self._uri)
        self.__dict__.update(self.__getstate__())  # the statements built go, as when pickled

    def guarded(self) -> list[Guarded]:
        """The tables with forgotten rows now (read each call); a change rebuilds the statements."""
        now = self._retrying("reading forgotten tables", self._read_guarded, self.uri)
        if now != self._guarded:
            self.__dict__.update(self.__getstate__(), _guarded=now)
        return now

    def _read_guarded(self) -> list[Guarded]:
        with self.engine.connect() as conn:
            return guarded_tables(conn)

    def rewritten(self, text: str, what: str, where: Condition | None = None) -> tuple[str, Bases]:
        """``text`` reading tables without their forgotten rows (or under ``where``), views
        expanded; and the base tables it reads."""
        guarded = self.guarded() if where is None else self._read_guarded()

        def rewrite() -> tuple[str, Bases]:
            with self.engine.connect() as conn:
                rewriter = Rewriter(conn, guarded, where)
                return rewriter.sql(text, what), rewriter.bases

        return self._retrying("reading the catalog", rewrite, what)

    def scores(self, text: str, params: Sequence[dict[str, Any]], timeout_s: float) -> list[Any]:
        """The one value ``text`` (a single SELECT, read without forgotten rows) gives for each
        of ``params``, in a read-only transaction rolled back; one that fails or runs past
        ``timeout_s`` gives None. Anything but one SELECT, or a parameter not given: refused."""
        stmt = self._reward(text)
        if params and (missing := set(stmt._bindparams) - set(params[0])):
            raise ConfigError(f"sql_reward: no value for parameter(s) {sorted(missing)}")
        out = []
        with self.engine.connect() as conn:
            for values in params:
                with _read_only(conn, timeout_s):
                    try:
                        out.append(conn.execute(stmt, values).scalar())
                    except sa.exc.DBAPIError:
                        out.append(None)
        return out

    def _reward(self, text: str) -> sa.TextClause:
        """``text`` checked to be one SELECT and rewritten without forgotten rows, once while
        no table joins or leaves the forgotten ones (each batch of answers reads the catalog)."""
        self.guarded()  # a change clears what is kept
        if text not in self._rewards:
            dialect = self.engine.dialect.name
            unbound = re.sub(r"(?<![:\w]):\w+", "NULL", text)  # placeholders parse in every dialect
            try:
                statements = sqlglot.parse(unbound, read=SQLGLOT_NAMES.get(dialect, dialect))
            except sqlglot.errors.ParseError:
                statements = []
            if len(statements) != 1 or not isinstance(statements[0], exp.Query):
                raise ConfigError(f"sql_reward {text[:60]!r}: not a single SELECT (read-only)")
            sql = self.rewritten(text, "sql_reward")[0] if self._guarded else text
            self._rewards[text] = sa.text(sql)
        return self._rewards[text]

    def _retrying(self, what: str, call: Callable[[], Any], source: str) -> Any:
        """``call`` retried on faults that heal; others a ConfigError (refused) or a QueryError."""
        try:
            transient = (sa.exc.OperationalError, sa.exc.InterfaceError)
            return self._with_retry(what, call, transient, lambda exc: not is_transient(exc))
        except sa.exc.StatementError as exc:
            if (refused := refusal(exc, self.uri)) is not None:
                raise refused from None
            raise QueryError(f"{source} failed on {self.uri}: {database_message(exc)}") from None

    def _rows(
        self, stmt: sa.Executable, params: dict[str, Any], source: str, raw: bool = False
    ) -> list[Any]:
        """The rows of one statement, with retries; ``raw``: the driver's own tuples."""

        def call() -> list[Any]:
            with self.engine.connect() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                if raw:
                    with conn.execute(stmt, params) as result:
                        return list(result.cursor.fetchall())
                try:
                    return list(conn.execute(stmt, params).all())
                except sa.exc.OperationalError as exc:
                    # SQLite's error for TEXT that is not UTF-8: a bad row, not a lost connection
                    if conn.dialect.name != "sqlite" or "decode to UTF-8" not in str(exc.orig):
                        raise
                    # read again, invalid UTF-8 kept as surrogate escapes so the row checks name it
                    dbapi: Any = conn.connection.dbapi_connection
                    dbapi.text_factory = lambda data: data.decode("utf-8", "surrogateescape")
                    try:
                        return list(conn.execute(stmt, params).all())
                    finally:
                        dbapi.text_factory = str

        return list(self._retrying("reading keys" if raw else "reading rows", call, source))

    def _source(self, query: Query, fingerprint: str | None = None) -> _Source:
        fingerprint = fingerprint or query.fingerprint()
        self.guarded()
        if fingerprint not in self._sources:
            if isinstance(query, Table):
                self._sources[fingerprint] = self._build_table(query)
            elif isinstance(query, RawSQL):
                self._sources[fingerprint] = self._build_raw(query)
            elif isinstance(query, Conversations):
                self._sources[fingerprint] = self._build_conversations(query)
            else:
                raise QueryError(
                    f"{query.source} is a MongoDB query and cannot run on SQL database "
                    f"{self.uri}; use llmtrain.Table(name) or llmtrain.sql(select, key=...)"
                )
        return self._sources[fingerprint]

    def _build_table(self, query: Table, filtered: bool = True) -> _Source:
        def reflect() -> sa.Table:
            name, found = query.name, sa.inspect(self.engine)
            if self.engine.dialect.name == "sqlite":  # any case there, but not in its reflection
                names = [*found.get_table_names(query.schema), *found.get_view_names(query.schema)]
                name = match_name(name, names, "table", self.uri, True)
            return sa.Table(name, sa.MetaData(), schema=query.schema, autoload_with=self.engine)

        try:
            table = self._retrying("reading the table schema", reflect, query.source)
        except sa.exc.NoSuchTableError:
            raise QueryError(f"{query.source} does not exist in {self.uri}") from None
        if query.key is not None:
            if query.key not in table.c:
                raise QueryError(f"{query.source} has no key column {query.key!r}")
            key = table.c[query.key]
        else:
            pk = list(table.primary_key.columns)
            if len(pk) != 1:
                what = f"a composite primary key {[c.name for c in pk]}" if pk else "no primary key"
                raise QueryError(
                    f"{query.source} has {what}, so rows cannot be paged in a stable order; "
                    "pass Table(..., key='column') naming a unique, non-null column, or use "
                    "llmtrain.sql(select, key=...) with a unique expression"
                )
            key = pk[0]
        names = [c.name for c in table.c]
        if missing := [name for name in query.columns or () if name not in table.c]:
            raise QueryError(f"{query.source} has no column {missing[0]!r}; columns: {names}")
        if self._guarded and filtered:  # read through the forgotten-row filter, views expanded
            q = self.engine.dialect.identifier_preparer.quote
            named = f"{q(query.schema)}.{q(table.name)}" if query.schema else q(table.name)
            text, _ = self.rewritten(f"SELECT * FROM {named}", query.source)
            typed = [sa.column(c.name, c.type) for c in table.c]
            table = sa.text(text).columns(*typed).subquery(table.name)
            key = table.c[key.name]
        columns = {name: table.c[name] for name in query.columns or names}
        where = (
            _text(f"({query.where_sql}\n)", query.params, query.source) if query.where_sql else None
        )
        return _Source(key, columns, where, query.source)

    def _build_conversations(self, query: Conversations) -> _Source:
        """One row per conversation: its key and last turn (what the snapshot records)."""
        messages = self._source(query.messages)
        by, order = messages.column(query.by), messages.column(query.order)
        grouped = messages.select(by.label(query.by), sa.func.max(order).label(TURNS))
        if (gone := self._forgotten_conversations(query)) is not None:
            grouped = grouped.where(by.not_in(gone))
        sub = grouped.group_by(by).subquery("llmtrain_conversations")
        return _Source(sub.c[query.by], {TURNS: sub.c[TURNS]}, None, query.source)

    def _forgotten_conversations(self, query: Conversations) -> Any:
        """Conversations holding a forgotten message, left out whole: other turns may quote it."""
        assert isinstance(query.messages, Table)
        if (found := self._forgotten_rows(query.messages, query.by)) is None:
            return None
        gone = found.columns(sa.column(query.by)).subquery("llmtrain_gone")
        return sa.select(gone.c[query.by]).where(gone.c[query.by].is_not(None))

    def _forgotten_rows(self, rows: Table, column: str) -> sa.TextClause | None:
        """``column`` of a base table's forgotten rows (None: none, or a view: it is rewritten)."""
        if not self._guarded:
            return None
        source = self.resolve(rows)
        schema, _, name = source.name.partition(".")
        mine = [g for g in self._guarded if (g.schema, g.table) == (schema, name)]
        if not mine or not source.traced:
            return None
        q = self.engine.dialect.identifier_preparer.quote
        return sa.text(
            " UNION ".join(
                f"SELECT t.{q(column)} FROM {q(g.keys_table)} f "
                f"JOIN {q(schema)}.{q(name)} t ON t.{q(g.key)} = f.k"
                for g in mine
            )
        )

    def _build_raw(self, query: RawSQL) -> _Source:
        sql = self.rewritten(query.text, query.source)[0] if self._guarded else query.text
        text = _text(sql, query.params, query.source)

        def columns() -> list[str]:
            sub = text.columns().subquery("llmtrain_probe")
            star: sa.Select[Any] = sa.select(sa.literal_column("*")).select_from(sub).limit(0)
            with self.engine.connect() as conn:
                return list(conn.execute(star).keys())

        probe = self._retrying("reading the query's columns", columns, query.source)
        # SQLite renames a repeated name to "name:1" where the others keep both or refuse
        renamed = {c.rsplit(":", 1)[0] for c in probe if re.fullmatch(r".+:\d+", c)}
        if repeated := sorted({c for c in probe if probe.count(c) > 1} | (renamed & set(probe))):
            raise QueryError(
                f"{query.source}: result column(s) {repeated} appear more than once, so "
                f"{query.key!r} would be ambiguous; give each a distinct name with AS"
            )
        if query.key not in probe:
            raise QueryError(
                f"{query.source}: key column {query.key!r} is not in its result columns {probe}"
            )
        sub = text.columns(*[sa.column(c) for c in probe]).subquery("llmtrain_q")
        return _Source(sub.c[query.key], {c: sub.c[c] for c in probe}, None, query.source)

    def key_name(self, query: Query) -> str:
        return self._source(query).key.name

    def _page(self, query: Query, fields: Fields, lower: Key | None, limit: int) -> KeyedRows:
        fingerprint, names = query.fingerprint(), tuple(fields)
        src = self._source(query, fingerprint)
        lower_type = None if lower is None else (src.key >= lower).right.type
        # bound types are keyed by identity: capped in case a key type makes one per call
        shape = (fingerprint, names, lower_type)
        stmt = self._pages.get(shape)
        if stmt is None:
            if len(self._pages) >= _MAX_PAGES:
                self._pages.clear()
            stmt = src.select(src.key, *[src.column(f) for f in names])
            if lower_type is not None:
                stmt = stmt.where(src.key >= sa.bindparam(_LOWER, type_=lower_type))
            stmt = stmt.order_by(src.key).limit(sa.bindparam(_LIMIT, type_=sa.Integer))
            self._pages[shape] = stmt
        values = {_LIMIT: limit} if lower is None else {_LIMIT: limit, _LOWER: lower}
        return _pairs(self._rows(stmt, values, query.source), names)

    def resolve(self, source: Query | str) -> Source:
        if isinstance(source, Table):
            schema, table, column = source.schema, source.name, source.key
        elif isinstance(source, RawSQL):
            if source.table is not None:
                (schema, table), column = split_name(source.table), source.key
            else:
                found, table, column = key_table(source.text, source.key, self.engine.dialect.name)
                schema = found or None
        elif isinstance(source, Conversations):
            return self.resolve(source.messages)
        elif isinstance(source, str):
            (schema, table), column = split_name(source), None
        else:
            self._source(source)  # the QueryError that says it is no SQL query
            raise AssertionError("unreachable")
        what = source.source if isinstance(source, Query) else f"table {source!r}"
        found = self._retrying(
            "reading the catalog",
            lambda: self._catalog(schema, table, column, isinstance(source, str)),
            what,
        )
        given = isinstance(source, RawSQL) and source.table is not None  # not traced: told
        return replace(found, traced=False) if given else found

    def _catalog(self, schema: str | None, table: str, column: str | None, typed: bool) -> Source:
        """``typed``: a name typed as in SQL, read as PostgreSQL reads it unquoted (Docs: docs)."""
        inspector = sa.inspect(self.engine)
        if schema is None:
            schema = inspector.default_schema_name or "main"
        else:
            schema = match_name(schema, inspector.get_schema_names(), "schema", self.uri, True)
        views = inspector.get_view_names(schema)
        names = [*inspector.get_table_names(schema), *views]
        if typed and self.engine.dialect.name == "postgresql" and table.lower() in names:
            table = table.lower()
        table = match_name(table, names, "table", f"{schema} of {self.uri}", fold=True)
        columns = {c["name"]: c for c in inspector.get_columns(table, schema)}
        if column is None:
            pk = inspector.get_pk_constraint(table, schema).get("constrained_columns") or []
            column = pk[0] if len(pk) == 1 else None
        if column is None:
            raise QueryError(
                f"{schema}.{table} has no single-column primary key: name its key column with "
                f"lt.Table({table!r}, key=...) (in fit(), forget() and trained_on() alike)"
            )
        if column not in columns:
            raise QueryError(f"{schema}.{table} has no key column {column!r}")
        python_type = _python_type(columns[column]["type"])
        if python_type in (None, object):  # an untyped (SQLite) column: what its keys hold
            python_type = self._held_type(schema, table, column)
        return Source(f"{schema}.{table}", column, python_type, traced=table not in views)

    def _text_of(self, query: Query) -> tuple[str, dict[str, Any]]:
        """The selection as one SELECT of its keys, and its parameters."""
        q = self.engine.dialect.identifier_preparer.quote
        if isinstance(query, RawSQL):
            return f"SELECT {q(query.key)} FROM ({query.text}) llmtrain_q", query.params
        rows, key = (query.messages, query.by) if isinstance(query, Conversations) else (query, "")
        if not isinstance(rows, Table):
            raise QueryError(f"{query.source} is no SQL query")
        key = key or self.key_name(rows)
        named = f"{q(rows.schema)}.{q(rows.name)}" if rows.schema else q(rows.name)
        where = f" WHERE ({rows.where_sql})" if rows.where_sql else ""
        return f"SELECT DISTINCT {q(key)} FROM {named}{where}", rows.params

    def reads(self, query: Query) -> list[str] | None:
        try:
            _, bases = self.rewritten(self._text_of(query)[0], query.source, lambda g, n: None)
        except QueryError:  # not parsed: which tables it reads is unknown
            return None
        return sorted(f"{schema}.{table}" for schema, table in bases)

    def derived_keys(self, query: Query, source: Source, keys: Sequence[Key]) -> list[Key]:
        """As the tables are now: the selection read with ``source`` narrowed to ``keys``."""
        sql, params = self._text_of(query)
        q = self.engine.dialect.identifier_preparer.quote
        schema, _, table = source.name.partition(".")
        target, named = (schema, table), f"{q(schema)}.{q(table)}"
        bound = {f"llmtrain_k{i}": k for i, k in enumerate(keys)}

        def only(guards: list[Guarded], name: str) -> str | None:
            inside = ", ".join(":" + p for p in bound)
            return f"{name}.{q(source.key)} IN ({inside})" if name == named else None

        text, bases = self.rewritten(sql, query.source, where=only)
        if target not in bases:
            return []
        stmt = _text(text, {**params, **bound}, query.source)
        return [r[0] for r in self._rows(stmt, {}, query.source)]

    def row_keys(self, source: Source, key: Key) -> list[Key]:
        q = self.engine.dialect.identifier_preparer.quote
        name = f"{q(source.name.partition('.')[0])}.{q(source.name.partition('.')[2])}"
        stmt = sa.text(f"SELECT {q(source.key)} FROM {name} WHERE {q(source.key)} = :k")
        return [r[0] for r in self._rows(stmt, {"k": key}, source.name)]

    def forget_keys(self, source: Source, keys: Sequence[Key]) -> list[tuple[int, Key]]:
        if not source.traced:
            raise QueryError(
                f"forget(): {source.name} is a view; forget the rows of the tables it reads, "
                "which every selection then leaves out"
            )
        stored = self._retrying(
            "writing forgotten keys",
            lambda: store_keys(self.engine, source, list(keys)),
            source.name,
        )
        self.guarded()
        return stored

    def _held_type(self, schema: str, table: str, column: str) -> type | None:
        """The one Python type of the smallest and largest key, or None (mixed, or empty)."""
        key = sa.Table(table, sa.MetaData(), sa.Column(column), schema=schema).c[column]
        with self.engine.connect() as conn:
            ends = [
                conn.execute(sa.select(key).order_by(order).limit(1)).scalar()
                for order in (key.asc(), key.desc())
            ]
        kinds = {type(k) for k in ends if k is not None}
        return kinds.pop() if len(kinds) == 1 else None

    def key_pages(
        self, query: Query, version_column: str | None, page_size: int
    ) -> Iterator[KeyPage]:
        """The base's, 3x faster where SQLAlchemy converts no value: driver rows, int64 keys. A
        table's own forgotten rows are read as keys (the database joins them to its key table)
        and left out here: a probe per row of a 10M-row scan costs more than the scan."""
        src = self._source(query)
        gone = self._forgotten_keys(query) if isinstance(query, Table) else None
        if gone is not None:
            src = self._build_table(query, filtered=False)  # type: ignore[arg-type]
        cols = [src.key, *([src.column(version_column)] if version_column else [])]
        if any(_converts(c.type, self.engine.dialect) for c in cols):
            yield from super().key_pages(query, version_column, page_size)
            return
        ints = _python_type(src.key.type) is int
        first = src.select(*cols).order_by(src.key).limit(sa.bindparam(_LIMIT, type_=sa.Integer))
        later = first.where(src.key >= sa.bindparam(_LOWER, type_=src.key.type))

        def fetch(lower: Any, limit: int) -> list[Any]:
            stmt, values = (first, {}) if lower is NO_KEY else (later, {_LOWER: lower})
            return self._rows(stmt, {**values, _LIMIT: limit}, query.source, raw=True)

        for rows, lower in keyset(fetch, page_size):
            keys: Any = list(map(itemgetter(0), rows))
            if ints and None not in keys:
                keys = np.array(keys, dtype=np.int64)
            check_keys(keys, lower, src.key.name, query.source)
            versions = [r[1] for r in rows] if version_column else None
            if gone is not None:
                kept = np.flatnonzero(~in_sorted(gone, key_digests(keys)))
                keys = keys[kept] if isinstance(keys, np.ndarray) else [keys[i] for i in kept]
                versions = [versions[i] for i in kept] if versions is not None else None
            yield KeyPage(keys, versions)

    def _forgotten_keys(self, query: Table) -> np.ndarray | None:
        """Sorted digests of a table's forgotten keys; None where the SQL itself leaves them out."""
        if (found := self._forgotten_rows(query, self.key_name(query))) is None:
            return None
        return np.unique(key_digests([r[0] for r in self._rows(found, {}, query.source, raw=True)]))

    def _by_keys(self, query: Query, fields: Fields, keys: list[Key]) -> KeyedRows:
        if isinstance(query, Conversations):
            src = self._source(query.messages)
            cols = [src.column(c) for c in query.columns]
            stmt = src.select(*cols).where(cols[0].in_(keys)).order_by(*cols[:2])
            if (gone := self._forgotten_conversations(query)) is not None:
                stmt = stmt.where(cols[0].not_in(gone))
            return conversations(self._rows(stmt, {}, query.source))
        src = self._source(query)
        stmt = src.select(src.key, *[src.column(f) for f in fields]).where(src.key.in_(keys))
        return _pairs(self._rows(stmt, {}, query.source), fields)
