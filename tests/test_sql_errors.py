"""SQL mistakes end in one clear error naming the query and the database's own message, at
once; only faults that can heal (a connection refused or lost) are retried."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from conftest import MY_ADMIN, PG_ADMIN, fill, fresh_database

import llmtrain as lt
from llmtrain.db import RetryPolicy
from llmtrain.db.backend import DataBackend
from llmtrain.errors import DatabaseNotFoundError, DatabaseUnavailableError

ROWS = [{"id": i, "text": f"row {i}", "lang": "en" if i % 2 else "fr"} for i in range(10)]


def _size(uri: str, query: lt.Query) -> int:
    return len(lt.CachedQueryDataset(lt.connect(uri), query, "text"))


def _fails_fast(exc_type: type[BaseException], match: str, call: Any) -> None:
    """``call`` raises at its first attempt: the backend never reconnects to retry it."""
    with (
        mock.patch.object(DataBackend, "reconnect", autospec=True) as reconnect,
        pytest.raises(exc_type, match=match) as info,
    ):
        call()
    assert reconnect.call_count == 0, "a permanent error was retried"
    assert "\n" not in str(info.value)


MISTAKES = {
    "missing column in where": (lt.Table("docs").where("nope = 1"), "nope"),
    "parameter without a value": (lt.Table("docs").where("lang = :lang"), "lang"),
    "ambiguous key in sql": (
        lt.sql("SELECT a.id, b.id, a.text FROM docs a JOIN docs b ON a.id = b.id", key="id"),
        r"(\['id'\] appear more than once|Duplicate column name 'id')",
    ),
    "multi-statement where": (lt.Table("docs", where="1 = 1; DELETE FROM docs"), ""),
    "parameter the where does not use": (
        lt.Table("docs", where="lang = 'en'", params={"lang": "en"}),
        "lang",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_sql_mistakes_are_one_query_error(sql_uri: str, mistake: str) -> None:
    fill(sql_uri, "docs", ROWS)
    query, message = MISTAKES[mistake]
    _fails_fast(lt.QueryError, f"{query.source}.*{message}", lambda: _size(sql_uri, query))
    assert _size(sql_uri, lt.Table("docs")) == 10  # nothing was deleted


@pytest.fixture
def pg_uri(tmp_path: Any) -> Iterator[str]:
    yield from fresh_database("postgresql", tmp_path)


@pytest.fixture
def maria_uri(tmp_path: Any) -> Iterator[str]:
    yield from fresh_database("mariadb", tmp_path)


def test_postgres_permission_denied_is_a_query_error(pg_uri: str) -> None:
    fill(pg_uri, "docs", ROWS)
    role = f"lt_ro_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_uri, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(sa.text(f"REVOKE ALL ON docs FROM {role}"))
    try:
        uri = pg_uri.replace("postgres@", f"{role}@", 1)
        _fails_fast(
            lt.QueryError,
            "table docs failed on .*permission denied for table docs",
            lambda: _size(uri, lt.Table("docs")),
        )
    finally:
        from llmtrain.db.engines import dispose_sql_engine

        dispose_sql_engine(pg_uri.replace("postgres@", f"{role}@", 1))
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()


def test_mariadb_permission_denied_is_reported_at_once(maria_uri: str) -> None:
    fill(maria_uri, "docs", ROWS)
    fill(maria_uri, "other", ROWS)
    user, database = f"lt_ro_{uuid.uuid4().hex[:8]}", maria_uri.rsplit("/", 1)[1]
    admin = sa.create_engine(maria_uri, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%'"))
        conn.execute(sa.text(f"GRANT SELECT ON {database}.other TO '{user}'@'%'"))
    try:
        uri = maria_uri.replace("root@", f"{user}@", 1)
        _fails_fast(lt.QueryError, "table docs.*denied", lambda: _size(uri, lt.Table("docs")))
        raw = lt.sql("SELECT id, text FROM docs", key="id")
        _fails_fast(lt.QueryError, "sql query.*denied", lambda: _size(uri, raw))
        assert _size(uri, lt.Table("other")) == 10
    finally:
        from llmtrain.db.engines import dispose_sql_engine

        dispose_sql_engine(maria_uri.replace("root@", f"{user}@", 1))
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP USER '{user}'@'%'"))
        admin.dispose()


@pytest.mark.parametrize("admin", [PG_ADMIN, MY_ADMIN], ids=["postgresql", "mariadb"])
def test_an_unknown_database_is_reported_at_once(admin: str) -> None:
    uri = f"{admin}/lt_missing_{uuid.uuid4().hex[:8]}"
    _fails_fast(
        DatabaseNotFoundError,
        r"(?i)cannot open .*(does not exist|unknown database)",
        lambda: _size(uri, lt.Table("docs")),
    )


def test_an_unopenable_sqlite_file_is_reported_at_once(tmp_path: Any) -> None:
    folder = tmp_path / "a_folder.db"
    folder.mkdir()
    _fails_fast(
        DatabaseNotFoundError,
        "unable to open database file",
        lambda: _size(f"sqlite:///{folder}", lt.Table("docs")),
    )


def test_a_refused_connection_is_still_retried() -> None:
    db = lt.connect(
        "postgresql://postgres@127.0.0.1:1/nowhere", retry=RetryPolicy(attempts=3, base=0.01)
    )
    with pytest.raises(DatabaseUnavailableError, match="failed after 3 attempts") as info:
        len(lt.CachedQueryDataset(db, lt.Table("docs"), "text"))
    assert "\n" not in str(info.value)


def test_query_types_are_checked_against_the_database(sqlite_uri: str) -> None:
    fill(sqlite_uri, "docs", ROWS)
    mongo = f"mongomock://localhost/lt_{uuid.uuid4().hex[:12]}"
    fill(mongo, "docs", ROWS)
    with pytest.raises(lt.QueryError, match="SQL query and cannot run on MongoDB.*Collection"):
        _size(mongo, lt.Table("docs"))
    with pytest.raises(lt.QueryError, match="SQL query and cannot run on MongoDB"):
        _size(mongo, lt.sql("SELECT id, text FROM docs", key="id"))
    with pytest.raises(lt.QueryError, match="MongoDB query and cannot run on SQL.*Table"):
        _size(sqlite_uri, lt.Collection("docs"))


def _wrapped(orig: BaseException) -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", {}, orig)


def test_what_heals_is_told_from_what_does_not() -> None:
    import sqlite3

    import psycopg.errors
    import pymysql.err

    from llmtrain.db.sql_errors import is_transient

    heals = [
        pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock"),
        pymysql.err.OperationalError(1205, "Lock wait timeout exceeded"),
        pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query"),
        psycopg.errors.DeadlockDetected("deadlock detected"),
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.errors.LockNotAvailable("could not obtain lock"),
        psycopg.OperationalError("connection to server at 127.0.0.1 failed: Connection refused"),
        sqlite3.OperationalError("database is locked"),
    ]
    stays = [
        pymysql.err.OperationalError(1142, "SELECT command denied to user"),
        pymysql.err.OperationalError(1049, "Unknown database 'x'"),
        psycopg.errors.InsufficientPrivilege("permission denied for table docs"),
        psycopg.OperationalError('connection failed: FATAL:  database "x" does not exist'),
        sqlite3.OperationalError("unable to open database file"),
        sqlite3.OperationalError("no such column: nope"),
    ]
    assert [is_transient(_wrapped(e)) for e in heals] == [True] * len(heals)
    assert [is_transient(_wrapped(e)) for e in stays] == [False] * len(stays)
