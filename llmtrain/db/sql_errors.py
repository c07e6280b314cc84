"""Which SQL errors heal (lost connections, restarts, lock waits: retried) and which do not (a
missing column, a denied login: reported at once, not after the retry budget as an outage)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from llmtrain.errors import ConfigError, DatabaseNotFoundError

# Lock conflicts, which a fresh transaction resolves: PostgreSQL's serialization failure,
# deadlock, lock not available; MySQL/MariaDB's lock wait timeout, deadlock; a busy SQLite file.
_PG_LOCKS = frozenset({"40001", "40P01", "55P03"})
_MYSQL_LOCKS = frozenset({1205, 1213})
_SQLITE_LOCKS = ("database is locked", "database table is locked")
# PostgreSQL SQLSTATEs that heal: connection (08), insufficient resources (53), shutdown or
# startup (57P0x), lock conflicts.
_PG_TRANSIENT_CLASSES = ("08", "53")
_PG_TRANSIENT = _PG_LOCKS | {"57P01", "57P02", "57P03"}
# MySQL/MariaDB: can't connect, gone away, lost connection, too many connections, shutdown,
# connection killed, idle disconnect; lock conflicts.
_MYSQL_TRANSIENT = _MYSQL_LOCKS | {2002, 2003, 2006, 2013, 2055, 1040, 1053, 1927, 4031}
_SQLITE_TRANSIENT = (*_SQLITE_LOCKS, "disk i/o error")
_MYSQL_DRIVERS = ("pymysql", "MySQLdb", "mysql", "mariadb")
# a server that answered and turned the connection away for good (libpq gives no SQLSTATE)
_PG_REFUSALS = ("does not exist", "authentication failed", "no password supplied", "pg_hba.conf")


def database_message(exc: BaseException) -> str:
    """The database's own message, first line (without SQLAlchemy's wrapping)."""
    orig = getattr(exc, "orig", None) or exc
    code, args = _mysql_code(orig), tuple(getattr(orig, "args", ()))
    if code is not None and len(args) > 1:  # pymysql's str() is the (code, message) tuple
        return f"{str(args[1]).splitlines()[0]} (error {code})"
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__


def _mysql_code(orig: Any) -> int | None:
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _pg_refused(orig: object) -> bool:
    return any(p in str(orig) for p in _PG_REFUSALS)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` (a SQLAlchemy DBAPIError) can succeed."""
    if getattr(exc, "connection_invalidated", False) or isinstance(exc, sa.exc.InterfaceError):
        return True  # InterfaceError: the driver's own connection is closed or broken
    orig = getattr(exc, "orig", None)
    module = type(orig).__module__  # builtins when there is none
    if module.startswith("psycopg"):
        state = getattr(orig, "sqlstate", None)
        if state is None:  # libpq's own error: refused, reset, timed out, or turned away
            return not _pg_refused(orig)
        return state in _PG_TRANSIENT or state[:2] in _PG_TRANSIENT_CLASSES
    if module.startswith(_MYSQL_DRIVERS):
        return _mysql_code(orig) in _MYSQL_TRANSIENT
    if module.startswith("sqlite3"):
        return any(p in str(orig).lower() for p in _SQLITE_TRANSIENT)
    # another driver: only what SQLAlchemy itself calls a lost connection heals
    return False


def is_lock_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` (a SQLAlchemy DBAPIError) is a lock conflict a new transaction resolves."""
    orig = getattr(exc, "orig", None)
    module = type(orig).__module__
    if module.startswith("psycopg"):
        return getattr(orig, "sqlstate", None) in _PG_LOCKS
    if module.startswith(_MYSQL_DRIVERS):
        return _mysql_code(orig) in _MYSQL_LOCKS
    return module.startswith("sqlite3") and any(p in str(orig).lower() for p in _SQLITE_LOCKS)


def refusal(exc: BaseException, where: str) -> ConfigError | None:
    """The error for a database (DatabaseNotFoundError) or login the server turned away."""
    orig = getattr(exc, "orig", None)
    module = type(orig).__module__
    if module.startswith("psycopg"):
        state = getattr(orig, "sqlstate", None)
        refused = _pg_refused(orig) if state is None else state == "3D000" or state[:2] == "28"
    elif module.startswith(_MYSQL_DRIVERS):
        refused = _mysql_code(orig) in (1044, 1045, 1049)
    else:
        refused = "unable to open database file" in str(orig).lower()
    if not refused:
        return None
    message = database_message(exc)
    found = "database" in message.lower() and "denied" not in message.lower()
    return (DatabaseNotFoundError if found else ConfigError)(f"cannot open {where}: {message}")
