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
