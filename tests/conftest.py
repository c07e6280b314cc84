"""Shared fixtures: a fresh database on each real backend (SQLite file, PostgreSQL, MariaDB,
mongomock), a real S3 API on loopback (moto's server), and a helper that fills a table or
collection with rows."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import sqlalchemy as sa

pytest_plugins = ["pytester"]
# property tests draw the same examples every run: a failure reproduces
hypothesis.settings.register_profile("seeded", derandomize=True)
hypothesis.settings.load_profile("seeded")

PG_ADMIN = os.environ.get("LLMTRAIN_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
MY_ADMIN = os.environ.get("LLMTRAIN_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306")
ALL_BACKENDS = ["sqlite", "postgresql", "mariadb", "mongomock"]
SQL_BACKENDS = ["sqlite", "postgresql", "mariadb"]
# Ray Train's controller notices a worker group's end at its next health check (every 2 s by
# default): the tests' Ray instances, and those of their subprocesses, check every 0.1 s
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
# `import demo`: examples/demo.py, the quick start, whose docs table and model tests reuse
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _no_skip_in_ci(report: Any) -> None:
    """In CI (``CI`` set) every skip fails: a test that would skip for a missing server,
    package or tool there would hide that its promise went untested."""
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every test: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A skip in a test, or in its fixtures' setup (a missing server)."""
    outcome = yield
    _no_skip_in_ci(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A skip while collecting (a module-level ``pytest.importorskip``)."""
    outcome = yield
    _no_skip_in_ci(outcome.get_result())  # type: ignore[attr-defined]


def _server_or_skip(kind: str, admin_url: str) -> sa.Engine:
    engine = sa.create_engine(
        f"{admin_url}/{'postgres' if kind == 'postgresql' else ''}", isolation_level="AUTOCOMMIT"
    )
    try:
        with engine.connect():
            pass
    except Exception as exc:  # noqa: BLE001
        engine.dispose()
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
        from llmtrain.db.engines import dispose_sql_engine

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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama (byte-level tokenizer), made once per test module."""
    from llmtrain.testing import tiny_model

    return tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(params=ALL_BACKENDS)
def any_uri(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture(params=SQL_BACKENDS)
def sql_uri(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture
def sqlite_uri(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path / 'data.db'}"


@dataclass(frozen=True)
class S3Server:
    """moto's S3 on 127.0.0.1; the dummy credentials are distinctive so a test can search
    the stores for them."""

    endpoint: str
    access_key: str
    secret_key: str

    def new_bucket(self) -> str:
        """A fresh, empty bucket; its name."""
        import boto3

        name = f"lt-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's ThreadedMotoServer on a free loopback port, with dummy credentials and the
    endpoint in the environment, where s3fs (and any subprocess) finds them."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}", "AKIALLMTRAINTEST0000", f"moto-{uuid.uuid4().hex}")
    env = {
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3.endpoint,
    }
    hidden = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")
    saved = {k: os.environ.get(k) for k in [*env, *hidden]}
    os.environ.update(env)
    for k in hidden:
        os.environ.pop(k, None)
    try:
        yield s3
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fill(
    uri: str,
    name: str,
    rows: list[dict[str, Any]],
    *,
    key: str = "id",
    text_columns: list[str] | None = None,
) -> None:
    """Create table/collection ``name`` holding ``rows`` (each has ``key``; SQL: INTEGER key,
    other columns TEXT unless their values are ints or bools). Mongo stores ``key`` as ``_id``."""
    if uri.startswith("mongo"):
        from llmtrain.db.engines import mongo_database

        coll = mongo_database(uri)[name]
        docs = [{("_id" if k == key else k): v for k, v in r.items()} for r in rows]
        for i in range(0, len(docs), 5000):
            coll.insert_many(docs[i : i + 5000])
        return
    from llmtrain.db.engines import sql_engine

    columns: dict[str, Any] = {}
    for r in rows:
        for k, v in r.items():
            if k != key and k not in columns:
                columns[k] = (
                    sa.Boolean
                    if isinstance(v, bool)
                    else sa.Integer
                    if isinstance(v, int)
                    else sa.Text
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
