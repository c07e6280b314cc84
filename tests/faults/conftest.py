"""Fixtures for the fault-injection suite: a tiny model and fresh server databases.

An unreachable PostgreSQL or MariaDB, or one that cannot be restarted here, skips the tests
that need it, and in CI (``CI`` set) every skip fails (the top-level conftest). Whatever a
test did to the server, the session ends with it up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmtrain.testing import tiny_model

from .helpers import (
    ensure_postgres_running,
    fresh_any_database,
    fresh_server_database,
    stopped_by_a_test,
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture
def pg_uri() -> Iterator[str]:
    yield from fresh_server_database("postgresql")


@pytest.fixture
def my_uri() -> Iterator[str]:
    yield from fresh_server_database("mariadb")


@pytest.fixture(params=["postgresql", "mariadb"])
def server_uri(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh PostgreSQL, then MariaDB, database (restart-safe)."""
    yield from fresh_server_database(request.param)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb", "mongomock"])
def uri_of(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database of every kind (restart-safe for the servers)."""
    yield from fresh_any_database(request.param, tmp_path)


@pytest.fixture(autouse=True, scope="session")
def _postgres_left_running() -> Iterator[None]:
    """Whatever a test did to the server, the suite ends with PostgreSQL up."""
    yield
    if stopped_by_a_test():
        ensure_postgres_running()
