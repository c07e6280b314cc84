"""Forgotten rows, left out by the database itself: ``db.forget`` copies a table's forgotten keys
into a table typed like its key column (``CREATE TABLE .. AS SELECT key``: same type, collation,
padding), and every statement llmtrain runs reads the table through ``NOT EXISTS`` against them,
views expanded, so the server's own equality rules decide. What cannot be rewritten (a table
function, a user function, SQL that does not parse) is refused while any row is forgotten."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
import sqlglot
from sqlglot import exp

from llmtrain.db.keys import Key
from llmtrain.db.sources import SQLGLOT_NAMES, Source, folded
from llmtrain.errors import QueryError

REGISTRY = "_llmtrain_forgotten"  # one row a table with forgotten keys: where they are kept
_VIEWS = {  # a view's definition (PostgreSQL: a materialized one's too), by schema and name
    "sqlite": "SELECT sql FROM {schema}.sqlite_master WHERE type = 'view' AND name = :n",
    "postgresql": "SELECT definition FROM pg_views WHERE schemaname = :s AND viewname = :n "
    "UNION ALL SELECT definition FROM pg_matviews WHERE schemaname = :s AND matviewname = :n",
    "mysql": "SELECT VIEW_DEFINITION FROM information_schema.VIEWS "
    "WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :n",
}
_VISIBLE = (
    "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :n"
)
_USER_FUNCTIONS = {  # functions of the database's users (they may read any table); SQLite: none
    "postgresql": "SELECT 1 FROM pg_proc p JOIN pg_namespace s ON s.oid = p.pronamespace WHERE "
    "lower(p.proname) = lower(:n) AND s.nspname NOT IN ('pg_catalog', 'information_schema')",
    "mysql": "SELECT 1 FROM information_schema.ROUTINES WHERE lower(ROUTINE_NAME) = lower(:n)",
}


@dataclass(frozen=True)
class Guarded:
    """A table with forgotten rows: its key column and the table holding those keys."""

    schema: str
    table: str
    key: str
    keys_table: str


def _registry() -> sa.Table:
    return sa.Table(
        REGISTRY,
        sa.MetaData(),
        sa.Column("identity", sa.String(300), primary_key=True),
        *[sa.Column(c, sa.String(128)) for c in ("schema_name", "table_name", "key_column")],
        sa.Column("keys_table", sa.String(64)),
    )


def guarded_tables(conn: sa.Connection) -> list[Guarded]:
    """Every table with forgotten rows (none, creating nothing, if no row was ever forgotten)."""
    if conn.dialect.name in ("mysql", "mariadb"):  # DESCRIBE: denied, not absent, to a user
        # without privileges; information_schema lists only what the user may see
        found = conn.execute(sa.text(_VISIBLE), {"n": REGISTRY}).first() is not None
    else:
        found = sa.inspect(conn).has_table(REGISTRY)
    if not found:
        return []
    reg = _registry()
    return [Guarded(*r) for r in conn.execute(sa.select(*list(reg.c)[1:]).order_by(reg.c[0]))]


def store_keys(engine: sa.Engine, source: Source, keys: Sequence[Key]) -> list[tuple[int, Key]]:
    """Add ``keys`` to the table's forgotten keys; (position, row's own key) of those it matched."""
    (schema, table), key, identity = source.name.split(".", 1), source.key, source.identity
    name = "_llmtrain_fk_" + hashlib.sha256(identity.encode()).hexdigest()[:16]
    q = engine.dialect.identifier_preparer.quote
    named, kept, batch = f"{q(schema)}.{q(table)}", q(name), uuid.uuid4().hex
    with engine.begin() as conn:
        if not sa.inspect(conn).has_table(name):
            for ddl in (
                f"CREATE TABLE {kept} AS SELECT {q(key)} AS k FROM {named} WHERE 1 = 0",
                f"ALTER TABLE {kept} ADD COLUMN n INTEGER",
                f"ALTER TABLE {kept} ADD COLUMN batch VARCHAR(32)",
                f"CREATE INDEX {q(name + '_k')} ON {kept} (k)",
            ):
                conn.execute(sa.text(ddl))
        reg = _registry()
        reg.create(conn, checkfirst=True)
        if conn.execute(sa.select(reg.c[0]).where(reg.c[0] == identity)).first() is None:
            conn.execute(reg.insert().values((identity, schema, table, key, name)))
        insert = sa.text(f"INSERT INTO {kept} (k, n, batch) VALUES (:k, :n, :b)")
        conn.execute(insert, [{"k": k, "n": i, "b": batch} for i, k in enumerate(keys)])
        matched = sa.text(
            f"SELECT f.n, t.{q(key)} FROM {kept} f JOIN {named} t ON t.{q(key)} = f.k "
            "WHERE f.batch = :b"
        )
        return [(int(n), k) for n, k in conn.execute(matched, {"b": batch})]


#: (a table's guards, its quoted name) -> the condition its rows are read under (None: all)
Condition = Callable[[list[Guarded], str], "str | None"]
Bases = set[tuple[str, str]]  # (schema, table) of each base table a statement reads


class Rewriter:
    """A statement's tables read under ``where`` (default: no forgotten rows), views expanded."""

    def __init__(
        self, conn: sa.Connection, guarded: list[Guarded], where: Condition | None = None
    ) -> None:
        self.conn, self.guarded, self.where = conn, guarded, where or self.excluding
        self.dialect = "mysql" if conn.dialect.name == "mariadb" else conn.dialect.name
        self.read = SQLGLOT_NAMES.get(self.dialect)
        self.inspector = sa.inspect(conn)
        self.default = self.inspector.default_schema_name or "main"
        self.quote = conn.dialect.identifier_preparer.quote
        self.bases: Bases = set()

    def excluding(self, guards: list[Guarded], name: str) -> str | None:
        """Rows whose key is none of the table's forgotten keys (of each key column forgotten)."""
        q = self.quote
        return (
            " AND ".join(
                f"NOT EXISTS (SELECT 1 FROM {q(g.keys_table)} llmtrain_f "
                f"WHERE {name}.{q(g.key)} = llmtrain_f.k)"
                for g in guards
            )
            or None
        )

    def refuse(self, why: str) -> QueryError:
        count = "SELECT count(*) FROM {}"
        counts = [
            f"{g.schema}.{g.table} "
            f"({self.conn.execute(sa.text(count.format(self.quote(g.keys_table)))).scalar()} keys)"
            for g in self.guarded
        ]
        return QueryError(
            f"{why}: llmtrain cannot tell which tables it reads, and rows of "
            f"{', '.join(counts) or 'its tables'} are forgotten (db.forget); select with plain "
            "SELECTs over tables and views, so the database leaves the forgotten rows out"
        )

    def sql(self, text: str, what: str) -> str:
        try:
            tree = sqlglot.parse_one(text, read=self.read)
        except sqlglot.errors.ParseError as exc:
            raise self.refuse(f"{what} does not parse ({str(exc).splitlines()[0]})") from None
        self._rewrite(tree, what, depth=0)
        tree = tree.transform(  # bound parameters stay ``:name`` in every dialect
            lambda n: exp.var(":" + n.name) if isinstance(n, exp.Placeholder) and n.name else n
        )
        return str(tree.sql(dialect=self.read))

    def _rewrite(self, tree: Any, what: str, depth: int) -> None:
        if depth > 16:
            raise self.refuse(f"{what} nests views more than 16 deep")
        for func in tree.find_all(exp.Anonymous):
            found = _USER_FUNCTIONS.get(self.dialect)
            if found and self.conn.execute(sa.text(found), {"n": func.name}).first():
                raise self.refuse(f"{what} calls the database's function {func.name}()")
        ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
        for node in list(tree.find_all(exp.Table)):
            if not isinstance(node.this, exp.Identifier):
                raise self.refuse(f"{what} reads the table function {node.this.sql()}")
            if node.args.get("db") is None and node.name in ctes:
                continue
            schema, name = self._catalog_name(node.args.get("db"), node.this)
            alias = node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(node.name))
            if node.args.get("db") is not None and not node.args.get("alias"):
                for column in tree.find_all(exp.Column):  # db.t.c (MariaDB's views): now t.c
                    if column.table == node.name and column.args.get("db") is not None:
                        column.set("db", None)
            if (view := self._view(schema, name)) is not None:
                inner = sqlglot.parse_one(view, read=self.read)
                if isinstance(inner, exp.Create):  # SQLite keeps the CREATE VIEW statement
                    if isinstance(inner.this, exp.Schema) and inner.this.expressions:
                        raise self.refuse(f"view {schema}.{name} names its columns")
                    inner = inner.expression
                self._rewrite(inner, f"view {schema}.{name}", depth + 1)
                node.replace(exp.Subquery(this=inner, alias=alias))
                continue
            self.bases.add((schema, name))
            mine = [g for g in self.guarded if (g.schema, g.table) == (schema, name)]
            quoted = f"{self.quote(schema)}.{self.quote(name)}"
            if (condition := self.where(mine, quoted)) is not None:
                sql = f"SELECT * FROM {quoted} WHERE {condition}"
                node.replace(exp.Subquery(this=sqlglot.parse_one(sql, read=self.read), alias=alias))

    def _catalog_name(self, schema_id: Any, name_id: Any) -> tuple[str, str]:
        """(schema, table) as the catalog spells them: SQLite matches any case, MariaDB exactly."""
        schema = self.default if schema_id is None else folded(schema_id, self.dialect)
        name = folded(name_id, self.dialect)
        if self.dialect == "sqlite":
            schema = schema.lower()
            names = [
                *self.inspector.get_table_names(schema),
                *self.inspector.get_view_names(schema),
            ]
            name = next((n for n in names if n.lower() == name.lower()), name)
        return schema, name

    def _view(self, schema: str, name: str) -> str | None:
        """The view's definition; None for a table."""
        sql = _VIEWS[self.dialect].format(schema=self.quote(schema))
        found = self.conn.execute(sa.text(sql), {"s": schema, "n": name}).scalar()
        return None if found is None else str(found).strip().rstrip(";")
