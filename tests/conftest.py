"""Shared fixtures: a fresh database on each real backend (SQLite file, PostgreSQL, MariaDB,
mongomock), and a helper that fills a table or collection with rows."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

PG_ADMIN = os.environ.get("LLMTRAIN_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
MY_ADMIN = os.environ.get("LLMTRAIN_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306")
ALL_BACKENDS = ["sqlite", "postgresql", "mariadb", "mongomock"]
SQL_BACKENDS = ["sqlite", "postgresql", "mariadb"]


def _server_or_skip(kind: str, admin_url: str) -> sa.Engine:
    engine = sa.create_engine(
        f"{admin_url}/{'postgres' if kind == 'postgresql' else ''}", isolation_level="AUTOCOMMIT"
    )
    try:
        with engine.connect():
            pass
    except Exception as exc:  # noqa: BLE001
        engine.dispose()
        if os.environ.get("CI"):
            pytest.fail(f"{kind} server is not reachable in CI: {exc}")
        pytest.skip(f"{kind} server not reachable at {admin_url}: {exc}")
    return engine


def fresh_database(kind: str, tmp_path: Any) -> Iterator[str]:
    """Yield the URI of a new, empty database of ``kind``; drop it afterwards."""
    name = f"lt_{uuid.uuid4().hex[:12]}"
    if kind == "sqlite":
        (tmp_path / f"{name}.db").touch()  # an empty database, as on the servers
        yield f"sqlite:///{tmp_path / (name + '.db')}"
        return
    if kind == "mongomock":
        yield f"mongomock://localhost/{name}"
        return
    admin = PG_ADMIN if kind == "postgresql" else MY_ADMIN
    engine = _server_or_skip(kind, admin)
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield f"{admin}/{name}"
    finally:
        from llmtrain.backends.engines import dispose_sql_engine

        dispose_sql_engine(f"{admin}/{name}")
        with engine.connect() as conn:
            if kind == "postgresql":
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :d AND pid <> pg_backend_pid()"
                    ),
                    {"d": name},
                )
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        engine.dispose()


@pytest.fixture(params=ALL_BACKENDS)
def any_uri(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture(params=SQL_BACKENDS)
def sql_uri(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture
def sqlite_uri(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path / 'data.db'}"


def fill(
    uri: str,
    name: str,
    rows: list[dict[str, Any]],
    *,
    key: str = "id",
    text_columns: list[str] | None = None,
) -> None:
    """Create table/collection ``name`` holding ``rows`` (each has ``key``; SQL: INTEGER key,
    other columns TEXT unless their values are ints). Mongo stores ``key`` as ``_id``."""
    if uri.startswith("mongo"):
        from llmtrain.backends.engines import mongo_database

        coll = mongo_database(uri)[name]
        docs = [{("_id" if k == key else k): v for k, v in r.items()} for r in rows]
        for i in range(0, len(docs), 5000):
            coll.insert_many(docs[i : i + 5000])
        return
    from llmtrain.backends.engines import sql_engine

    columns: dict[str, Any] = {}
    for r in rows:
        for k, v in r.items():
            if k != key and k not in columns:
                columns[k] = (
                    sa.Integer if isinstance(v, int) and not isinstance(v, bool) else sa.Text
                )
    for c in text_columns or []:
        columns.setdefault(c, sa.Text)
    meta = sa.MetaData()
    table = sa.Table(
        name,
        meta,
        sa.Column(key, sa.Integer, primary_key=True, autoincrement=False),
        *[sa.Column(c, t, nullable=True) for c, t in columns.items()],
    )
    engine = sql_engine(uri, create=True)
    meta.create_all(engine)
    with engine.begin() as conn:
        for i in range(0, len(rows), 5000):
            chunk = [{c: r.get(c) for c in [key, *columns]} for r in rows[i : i + 5000]]
            if chunk:
                conn.execute(table.insert(), chunk)
