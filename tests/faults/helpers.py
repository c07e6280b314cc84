"""What the fault-injection tests share: rows, trainers, PostgreSQL's lifecycle, a switch
that kills database sessions from the server side, and counters of what was read."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from conftest import MY_ADMIN, PG_ADMIN, _server_or_skip
from safetensors.torch import load_file

import llmtrain as lt

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]


def doc_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {"id": i, "instruction": f"What is color number {i % 8}?", "output": COLORS[i % 8]}
        for i in range(start, start + n)
    ]


def admin_engine(kind: str) -> sa.Engine:
    """An AUTOCOMMIT engine on the server (skips, or fails in CI, when it is unreachable).

    Without a pool: a test may restart the server, and a pooled connection would not survive.
    """
    admin = PG_ADMIN if kind == "postgresql" else MY_ADMIN
    _server_or_skip(kind, admin).dispose()
    return sa.create_engine(
        f"{admin}/{'postgres' if kind == 'postgresql' else ''}",
        isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
    )


def fresh_server_database(kind: str) -> Iterator[str]:
    """The URI of a new, empty PostgreSQL or MariaDB database; dropped afterwards (and its
    sessions ended first), even if the server was restarted meanwhile."""
    from llmtrain.db.engines import dispose_sql_engine

    engine = admin_engine(kind)
    name = f"lt_{uuid.uuid4().hex[:12]}"
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    uri = f"{PG_ADMIN if kind == 'postgresql' else MY_ADMIN}/{name}"
    try:
        yield uri
    finally:
        dispose_sql_engine(uri)
        if kind == "postgresql":
            ensure_postgres_running()
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


def database_name(uri: str) -> str:
    return sa.engine.make_url(uri).database or ""


def trainer(tiny: Path, name: str, **kwargs: Any) -> lt.LLMTrainer:
    options: dict[str, Any] = {
        "max_steps": 6,
        "batch_size": 4,
        "learning_rate": 1e-2,
        "lora_r": 8,
        "progress_bar": False,
        "logging_steps": 1,
        "lora_dropout": 0.1,
    }
    options.update(kwargs)
    return lt.LLMTrainer(name, model=tiny, prompt_template=TEMPLATE, **options)


def adapter(db: Any, model: Any, folder: Path) -> dict[str, torch.Tensor]:
    """The stored adapter weights of a fitted model."""
    target = folder / f"adapter-{model.identifier}-{model.version}-{model.record.run_id[:8]}"
    db.artifacts.get_dir(model.record.adapter, target)
    return load_file(str(target / "adapter_model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit for bit: CPU training is deterministic, so a resumed run must not differ at all."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def fresh_any_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """``fresh_server_database`` for the servers, the shared fixture's for the others."""
    from conftest import fresh_database

    if kind in ("postgresql", "mariadb"):
        yield from fresh_server_database(kind)
    else:
        yield from fresh_database(kind, tmp_path)


# -- PostgreSQL's lifecycle -------------------------------------------------------------------
_stopped = {"by_a_test": False}


def pg_cluster() -> tuple[str, str]:
    """``(version, name)`` of the local cluster on port 5432, as ``pg_ctlcluster`` names it;
    skips (fails in CI) where the server is not managed that way."""
    found = (
        shutil.which("pg_lsclusters")
        and subprocess.run(
            ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=False
        ).stdout
    )
    for line in (found or "").splitlines():
        version, name, port, *_ = line.split()
        if port == "5432":
            return version, name
    pytest.skip("no pg_ctlcluster-managed PostgreSQL cluster on port 5432 to restart")


def pg_ctl(action: str) -> None:
    version, name = pg_cluster()
    if action == "stop":
        _stopped["by_a_test"] = True
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, name, action],
        check=True,
        capture_output=True,
        timeout=120,
    )


def postgres_ready() -> bool:
    return (
        subprocess.run(
            ["pg_isready", "-q", "-h", "127.0.0.1", "-p", "5432"], check=False
        ).returncode
        == 0
    )


def stopped_by_a_test() -> bool:
    return _stopped["by_a_test"]


def ensure_postgres_running(timeout: float = 60) -> None:
    """Start the cluster if a test left it down, and wait until it takes connections."""
    if not _stopped["by_a_test"] or postgres_ready():
        return
    version, name = pg_cluster()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, name, "start"],
        check=False,
        capture_output=True,
        timeout=120,
    )
    deadline = time.monotonic() + timeout
    while not postgres_ready():
        if time.monotonic() > deadline:
            raise RuntimeError("PostgreSQL did not come back")
        time.sleep(0.2)


# -- killing sessions from the server side ----------------------------------------------------
class SessionKiller:
    """Kills llmtrain's own database session from another connection, right after the pool
    hands it out (so the statement about to run finds it dead), on every ``every``-th
    checkout of a connection to ``database``: ``pg_terminate_backend`` on PostgreSQL,
    ``KILL <id>`` on MariaDB. ``every=1`` kills them all: the database is gone for good.
    ``thread`` limits it to checkouts made by that thread (``"llmtrain-prefetch"``: the
    training data reads, not the metadata writes)."""

    def __init__(
        self, kind: str, database: str, every: int, *, thread: str | None = None, armed: bool = True
    ) -> None:
        self.kind, self.database, self.every, self.thread = kind, database, every, thread
        self.armed = armed  # flip it while training runs: (un)listening then is not safe
        self.admin = admin_engine(kind)
        self.checkouts = self.kills = 0

    def _session(self, dbapi_conn: Any) -> int | None:
        """The server's id of this session, if it is one of ``database`` (else None)."""
        if self.kind == "postgresql":
            import psycopg

            if (
                not isinstance(dbapi_conn, psycopg.Connection)
                or dbapi_conn.info.dbname != self.database
            ):
                return None
            return int(dbapi_conn.info.backend_pid)
        import pymysql

        if (
            not isinstance(dbapi_conn, pymysql.connections.Connection)
            or (dbapi_conn.db or b"").decode() != self.database
        ):
            return None
        return int(dbapi_conn.thread_id())

    def _on_checkout(self, dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        if not self.armed:
            return
        session = self._session(dbapi_conn)
        if session is None or (self.thread and threading.current_thread().name != self.thread):
            return
        self.checkouts += 1
        if self.checkouts % self.every:
            return
        with self.admin.connect() as conn:
            if self.kind == "postgresql":
                conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": session})
            else:
                conn.execute(sa.text(f"KILL {session}"))
        self.kills += 1
        time.sleep(0.02)  # let the server drop it before the statement goes out

    def __enter__(self) -> SessionKiller:
        sa.event.listen(sa.pool.Pool, "checkout", self._on_checkout)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(sa.pool.Pool, "checkout", self._on_checkout)
        self.admin.dispose()


@contextmanager
def warnings_of(caplog: pytest.LogCaptureFixture, logger: str) -> Iterator[list[str]]:
    """The messages ``logger`` warns with inside the block."""
    caplog.set_level("WARNING", logger=logger)
    start = len(caplog.records)
    found: list[str] = []
    yield found
    found.extend(r.getMessage() for r in caplog.records[start:] if r.name == logger)


class CountingBackend:
    """Wraps a Datalayer's backend and counts what it reads (to prove nothing was read)."""

    READS = ("fetch_rows", "fetch_by_keys")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.rows = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in self.READS:
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            result = value(*args, **kwargs)
            if name in ("fetch_rows", "fetch_by_keys"):
                self.rows += len(result)
            return result

        return counted


def count_reads(db: Any) -> CountingBackend:
    counting = CountingBackend(db.backend)
    db._backend = counting
    return counting


def count_reconnects(db: Any) -> list[float]:
    """The backend's reconnects (one before each retry of a read), as they happen."""
    backend, seen = db.backend, []
    reconnect = backend.reconnect

    def counted() -> None:
        seen.append(time.monotonic())
        reconnect()

    backend.reconnect = counted
    return seen
