"""Sources as the catalog spells them (``schema.table``): ``docs`` and ``public.docs`` are one."""

from __future__ import annotations

import numbers
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bson import ObjectId

from llmtrain.db.keys import Key
from llmtrain.errors import ConfigError, QueryError


@dataclass(frozen=True)
class Source:
    """Where a selection's keys come from: canonical ``name``, key column, the type it holds."""

    name: str
    key: str
    key_type: type | None
    traced: bool = True  # a selection's keys are this table's own (not a view's, or computed)

    @property
    def identity(self) -> str:
        """What forget records and runs are matched by: the table and its key column."""
        return f"{self.name}({self.key})"

    def typed(self, keys: Sequence[Any], where: str = "forget()") -> list[Key]:
        """``keys`` as the key column holds them (digit strings as ints, hex as ObjectIds, ...)."""
        return [self._typed(k, where) for k in keys]

    def _typed(self, key: Any, where: str) -> Key:
        if isinstance(key, str) and len(key) > 4096:  # kept in records (PG indexes 2704 bytes)
            raise ConfigError(f"{where}: a key of {len(key)} characters (at most 4096)")
        want = self.key_type
        if want is not None and type(key) is want:
            return key
        if isinstance(key, (dict, list, tuple, set)) or key is None or isinstance(key, bool):
            return self._refuse(key, where)
        if want is None:
            return key
        if want is int or issubclass(want, int):  # also numpy and enum integers, bson Int64
            if isinstance(key, numbers.Integral):
                return want(int(key))
            if isinstance(key, float) and key.is_integer():
                return int(key)
            if isinstance(key, str) and re.fullmatch(r"-?\d{1,20}", key.strip()):  # 64 bits
                return int(key)
        elif want is ObjectId and isinstance(key, str) and ObjectId.is_valid(key):
            return ObjectId(key)
        elif want is uuid.UUID and isinstance(key, str):
            try:
                return uuid.UUID(key)
            except ValueError:
                pass
        if isinstance(key, want):  # a subclass (numpy's str_): the exact type digests alike
            return str(key) if want is str else key
        return self._refuse(key, where)

    def _refuse(self, key: Any, where: str) -> Key:
        holds = self.key_type.__name__ if self.key_type else "document ids"
        raise ConfigError(
            f"{where}: key {key!r:.40} ({type(key).__name__}) is not a key of {self.name}, whose "
            f"{self.key!r} column holds {holds}"
        )


SQLGLOT_NAMES = {"postgresql": "postgres", "mysql": "mysql", "mariadb": "mysql", "sqlite": "sqlite"}


def folded(ident: Any, dialect: str) -> str:
    """A sqlglot name as the catalog spells it: PostgreSQL reads ``Docs`` unquoted as ``docs``."""
    name = str(ident.name)
    return name.lower() if dialect == "postgresql" and not getattr(ident, "quoted", True) else name


def key_table(text: str, key: str, dialect: str) -> tuple[str, str, str]:
    """(schema, table, column) a SELECT's ``key`` comes from: a bare column of its only table or of
    the one its qualifier names (alias first), as the catalog spells them (:func:`folded`); else
    (computed, UNION) a QueryError: pass source=."""
    import sqlglot
    from sqlglot import exp

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


def match_name(wanted: str, names: Sequence[str], what: str, where: str, fold: bool) -> str:
    """The catalog's spelling of ``wanted``: exact, or (``fold``) its one case-insensitive match."""
    if wanted in names:
        return wanted
    if fold:
        found = [n for n in names if n.lower() == wanted.lower()]
        if len(found) == 1:
            return found[0]
    shown = ", ".join(sorted(n for n in names if not n.startswith("_llmtrain"))[:20]) or "none"
    raise QueryError(f"no {what} {wanted!r} in {where}, which has: {shown}")


def split_name(name: Any) -> tuple[str | None, str]:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"a source is a table or collection name or a query, got {name!r}")
    schema, _, table = name.strip().rpartition(".")
    return schema or None, table
