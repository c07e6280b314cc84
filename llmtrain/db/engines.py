"""One SQLAlchemy engine / Mongo client per URI per process, shared by backend and stores."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmtrain.errors import ConfigError, DatabaseNotFoundError
from llmtrain.uri import redact_uri, scheme_of

_lock = threading.Lock()
_engines: dict[tuple[int, str], Any] = {}
_clients: dict[tuple[int, str], Any] = {}

_DEFAULT_DRIVERS = {
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mariadb": "mariadb+pymysql",
}


def sqlalchemy_url(uri: str) -> str:
    """Pick the drivers llmtrain installs when the URI names none."""
    scheme, rest = uri.split("://", 1)
    return f"{_DEFAULT_DRIVERS[scheme]}://{rest}" if scheme in _DEFAULT_DRIVERS else uri


def sqlite_path(uri: str) -> Path | None:
    """The file a ``sqlite:///`` URI names; None for in-memory and ``file:`` URIs."""
    if scheme_of(uri) != "sqlite" or ":///" not in uri:
        return None
    path, _, query = uri.split(":///", 1)[1].partition("?")
    if not path or path == ":memory:" or path.startswith("file:") or "uri=true" in query:
        return None
    return Path(path).expanduser()


def sql_engine(uri: str, *, create: bool = False) -> Any:
    """The shared engine; a missing SQLite file is made only on ``create`` (never from a typo)."""
    import sqlalchemy as sa

    path = sqlite_path(uri)
    if path is not None and not create and not path.exists():
        raise DatabaseNotFoundError(
            f"no SQLite database at {path} ({redact_uri(uri)}): check the path"
        )
    key = (os.getpid(), uri)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            url = sqlalchemy_url(uri)
            connect_args = {"timeout": 60} if url.startswith("sqlite") else {}
            try:
                engine = sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
            except Exception as exc:  # noqa: BLE001 - driver errors vary; name the URI
                raise ConfigError(f"cannot open {redact_uri(uri)}: {exc}") from None
            if url.startswith("sqlite"):
                sa.event.listen(engine, "connect", _sqlite_pragmas)
            _engines[key] = engine
        return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    """WAL lets readers and one writer work at once (several trainers, one file)."""
    dbapi_conn.execute("PRAGMA journal_mode=WAL")
    dbapi_conn.execute("PRAGMA busy_timeout=60000")


def dispose_sql_engine(uri: str) -> None:
    with _lock:
        engine = _engines.pop((os.getpid(), uri), None)
    if engine is not None:
        engine.dispose()


def mongo_database(uri: str) -> Any:
    """The URI's database on a shared pymongo client (``mongomock://``: a mongomock one)."""
    name = urlsplit(uri).path.lstrip("/").split("?", 1)[0]
    if not name:
        raise ConfigError(
            f"{redact_uri(uri)}: the URI path must name the database (mongodb://host/dbname)"
        )
    # a mongomock client *is* its data: a forked DataLoader worker keeps using the copy
    key = (0, uri.split("?", 1)[0]) if scheme_of(uri) == "mongomock" else (os.getpid(), uri)
    with _lock:
        client = _clients.get(key)
        if client is None:
            if scheme_of(uri) == "mongomock":
                try:
                    import mongomock
                except ImportError as exc:
                    raise ConfigError(
                        "mongomock:// needs the mongomock package (pip install 'llmtrain[dev]')"
                    ) from exc
                client = mongomock.MongoClient()
            else:
                import pymongo

                client = pymongo.MongoClient(uri, serverSelectionTimeoutMS=10_000)
            _clients[key] = client
    return client[name]


def drop_mongo_client(uri: str) -> None:
    """Close a real client so the next call reconnects; a mongomock one *is* the data."""
    if scheme_of(uri) == "mongomock":
        return
    with _lock:
        client = _clients.pop((os.getpid(), uri), None)
    if client is not None:
        client.close()
