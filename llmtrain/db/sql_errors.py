"""Which SQL errors can heal (retry them) and which cannot (report them at once).

Retrying is only worth it for faults that go away by themselves: a lost connection, a
server restarting or refusing connections for a moment, a lock wait or deadlock. Everything
else (a missing column, a denied permission, an unknown database, a SQLite file that cannot
be opened) fails the same way on every attempt, so it is reported with the database's own
message instead of after the whole retry budget (4-6 s) as an outage.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from llmtrain.errors import ConfigError, DatabaseNotFoundError

# PostgreSQL SQLSTATE classes and codes that heal: connection exceptions (08), operator
# intervention while the server shuts down or starts (57P01-57P03), serialization failure,
# deadlock, lock not available, insufficient resources (53: too many connections, ...).
_PG_TRANSIENT_CLASSES = ("08", "53")
_PG_TRANSIENT = frozenset({"57P01", "57P02", "57P03", "40001", "40P01", "55P03"})
# MySQL/MariaDB error numbers that heal: can't connect (2002, 2003), gone away (2006),
# lost connection (2013, 2055), too many connections (1040), server shutdown (1053),
# lock wait timeout (1205), deadlock (1213), connection killed (1927), idle disconnect (4031).
_MYSQL_TRANSIENT = frozenset({2002, 2003, 2006, 2013, 2055, 1040, 1053, 1205, 1213, 1927, 4031})
_SQLITE_TRANSIENT = ("database is locked", "database table is locked", "disk i/o error")


def database_message(exc: BaseException) -> str:
    """The database's own message, first line (without SQLAlchemy's wrapping)."""
    orig = getattr(exc, "orig", None) or exc
    code, args = _mysql_code(orig), tuple(getattr(orig, "args", ()))
    if code is not None and len(args) > 1:  # pymysql's str() is the (code, message) tuple
        return f"{str(args[1]).splitlines()[0]} (error {code})"
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__


# a server that answered and turned the connection away for good (libpq gives no SQLSTATE)
_PG_REFUSALS = ("does not exist", "authentication failed", "no password supplied", "pg_hba.conf")


def _mysql_code(orig: Any) -> int | None:
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _pg_refused(orig: object) -> bool:
    """libpq's error (no SQLSTATE) for a database or login the server turned away."""
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
    if module.startswith(("pymysql", "MySQLdb", "mysql", "mariadb")):
        return _mysql_code(orig) in _MYSQL_TRANSIENT
    if module.startswith("sqlite3"):
        return any(p in str(orig).lower() for p in _SQLITE_TRANSIENT)
    # another driver: only what SQLAlchemy itself calls a lost connection heals
    return False


def refusal(exc: BaseException, where: str) -> ConfigError | None:
    """A database or login the server turned away, as the user's mistake: a
    DatabaseNotFoundError for a database that is not there, else a ConfigError (bad
    credentials, an unopenable SQLite file); None for any other error."""
    if not is_connection_error(exc):
        return None
    message = database_message(exc)
    found = "database" in message.lower() and "denied" not in message.lower()
    return (DatabaseNotFoundError if found else ConfigError)(f"cannot open {where}: {message}")


def is_connection_error(exc: BaseException) -> bool:
    """A permanent error about reaching the database (unknown database, bad credentials,
    an unopenable SQLite file) rather than about one statement."""
    orig = getattr(exc, "orig", None)
    module = type(orig).__module__
    if module.startswith("psycopg"):
        state = getattr(orig, "sqlstate", None)
        if state is None:
            return _pg_refused(orig)
        return state == "3D000" or state.startswith("28")
    if module.startswith(("pymysql", "MySQLdb", "mysql", "mariadb")):
        return _mysql_code(orig) in (1044, 1045, 1049)
    return "unable to open database file" in str(orig).lower()
