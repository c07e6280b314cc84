"""The database goes away mid-epoch: sessions killed from the server side (PostgreSQL's
``pg_terminate_backend``, MariaDB's ``KILL``), a PostgreSQL restart, Mongo network errors.

Promise: each read is retried with bounded backoff and reconnects; the epoch goes on with no
row lost or repeated (the same keys, in the same order, as an uninterrupted epoch). Past the
retry budget a read fails with a clear ``DatabaseUnavailableError``, a fit fails and marks its
run failed, and its last checkpoint stays resumable once the database is back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo.errors
import pytest
import sqlalchemy as sa
from conftest import fill
from hooks import KeyTrace

import llmtrain as lt
from llmtrain.db.retry import RetryPolicy
from llmtrain.errors import DatabaseUnavailableError

from .helpers import (
    SessionKiller,
    adapter,
    admin_engine,
    assert_same_weights,
    count_reconnects,
    database_name,
    doc_rows,
    ensure_postgres_running,
    fresh_any_database,
    pg_cluster,
    pg_ctl,
    trainer,
    warnings_of,
)

FAST = RetryPolicy(attempts=6, base=0.01, cap=0.05)
ROWS = 600


def rows(n: int = ROWS) -> list[dict[str, Any]]:
    return [{"id": i, "instruction": f"instr {i}", "output": f"out {i}"} for i in range(n)]


def epoch(
    db: Any,
    select: lt.Query,
    *,
    prefetch: bool = True,
    after_rows: int = -1,
    fault: Callable[[], None] | None = None,
) -> Iterator[Any]:
    """The keys of one shuffled epoch read in windows of 50 (each row checked against its
    key); ``fault()`` is injected once ``after_rows`` rows have been consumed."""
    ds = lt.CachedQueryDataset(
        db,
        select,
        ["instruction", "output"],
        cache_size=50,
        seed=3,
        return_keys=True,
        prefetch=prefetch,
    )
    for i, row in enumerate(ds):
        if i == after_rows and fault is not None:
            fault()
        assert row["instruction"] == f"instr {row['_key']}"
        yield row["_key"]


def uninterrupted(uri: str, select: lt.Query) -> list[Any]:
    db = lt.connect(uri)
    try:
        return list(epoch(db, select))
    finally:
        db.close()


def test_sessions_killed_by_the_server_mid_epoch_lose_and_repeat_no_row(
    server_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    uri = server_uri
    kind = "postgresql" if uri.startswith("postgresql") else "mariadb"
    fill(uri, "docs", rows())
    expected = uninterrupted(uri, lt.Table("docs"))
    db = lt.connect(uri, retry=FAST)
    with (
        warnings_of(caplog, "llmtrain.db") as retried,
        SessionKiller(kind, database_name(uri), every=3) as killer,
    ):
        got = list(epoch(db, lt.Table("docs")))
    db.close()
    assert got == expected  # same rows, same order: nothing lost, nothing read twice
    assert len(set(got)) == ROWS
    assert killer.kills >= 5, killer.kills
    # a window's read (its check for newly forgotten tables, or its rows) was cut and retried
    reads = ("reading rows", "reading forgotten tables")
    assert any(r in m and "retrying" in m for m in retried for r in reads), retried


def test_postgres_restart_mid_epoch_loses_and_repeats_no_row(
    pg_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    pg_cluster()  # skips (fails in CI) unless the server can be restarted here
    fill(pg_uri, "docs", rows())
    expected = uninterrupted(pg_uri, lt.Table("docs"))
    admin = admin_engine("postgresql")

    def started_at() -> Any:
        with admin.connect() as conn:
            return conn.execute(sa.text("SELECT pg_postmaster_start_time()")).scalar()

    before = started_at()
    admin.dispose()
    restarter: list[threading.Thread] = []
    policy = RetryPolicy(attempts=12, base=0.2, cap=1.0)  # ~7 s: enough for a restart
    db = lt.connect(pg_uri, retry=policy)
    reconnects = count_reconnects(db)

    def start_once_a_read_failed() -> None:
        deadline = time.monotonic() + 30
        while not reconnects and time.monotonic() < deadline:  # a read met the down server
            time.sleep(0.01)
        pg_ctl("start")

    def restart() -> None:
        pg_ctl("stop")  # fast shutdown: every session is cut
        thread = threading.Thread(target=start_once_a_read_failed)
        thread.start()
        restarter.append(thread)

    try:
        with warnings_of(caplog, "llmtrain.db") as retried:
            got = list(epoch(db, lt.Table("docs"), after_rows=120, fault=restart))
    finally:
        for thread in restarter:
            thread.join(timeout=120)
        ensure_postgres_running()
        db.close()
    assert got == expected
    assert reconnects  # a read failed while the server was down, and was retried
    assert started_at() > before  # the server really went down and came back
    admin.dispose()
    assert any("retrying" in m for m in retried), "no read ever saw the server down"


def test_mongo_network_errors_are_retried_and_lose_no_document(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import mongomock.collection

    uri = f"mongomock://localhost/lt_{uuid.uuid4().hex[:12]}"
    fill(uri, "docs", rows())
    select = lt.Collection("docs")
    expected = uninterrupted(uri, select)
    find = mongomock.collection.Collection.find
    calls = {"n": 0, "raised": 0}

    def flaky_find(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if self.name == "docs" and calls["n"] % 3 == 0:
            calls["raised"] += 1
            raise pymongo.errors.AutoReconnect("connection reset by peer (injected)")
        return find(self, *args, **kwargs)

    monkeypatch.setattr(mongomock.collection.Collection, "find", flaky_find)
    db = lt.connect(uri, retry=FAST)
    with warnings_of(caplog, "llmtrain.db") as retried:
        got = list(epoch(db, select))
    assert got == expected
    assert calls["raised"] >= 3 and len(retried) == calls["raised"]


class Outage:
    """Flipped on, every read of the database fails until it is flipped off: all sessions
    killed (SQL), or every ``find`` refused (Mongo)."""

    def __init__(self, kind: str, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kind, self.uri, self.on = kind, uri, False
        self.killer: SessionKiller | None = None
        if kind != "mongomock":  # listening now: a listener added mid-read is not safe
            self.killer = SessionKiller(kind, database_name(uri), every=1, armed=False)
            self.killer.__enter__()
        else:
            import mongomock.collection

            find = mongomock.collection.Collection.find

            def down(coll: Any, *args: Any, **kwargs: Any) -> Any:
                if self.on:
                    raise pymongo.errors.ServerSelectionTimeoutError("no servers (injected)")
                return find(coll, *args, **kwargs)

            monkeypatch.setattr(mongomock.collection.Collection, "find", down)

    def start(self) -> None:
        self.on = True
        if self.killer is not None:
            self.killer.armed = True

    def stop(self) -> None:
        self.on = False
        if self.killer is not None:
            self.killer.armed = False

    def close(self) -> None:
        self.stop()
        if self.killer is not None:
            self.killer.__exit__(None, None, None)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb", "mongomock"])
def test_past_the_retry_budget_a_read_fails_with_database_unavailable(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    databases = fresh_any_database(kind, tmp_path)
    uri = next(databases)
    outage = Outage(kind, uri, monkeypatch)
    try:
        fill(uri, "docs", rows())
        select = lt.Collection("docs") if kind == "mongomock" else lt.Table("docs")
        expected = uninterrupted(uri, select)
        db = lt.connect(uri, retry=RetryPolicy(attempts=3, base=0.01, cap=0.02))
        got: list[Any] = []
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailableError) as info:
            for key in epoch(db, select, prefetch=False, after_rows=120, fault=outage.start):
                got.append(key)
        assert time.monotonic() - started < 30
        message = str(info.value)
        assert "failed after 3 attempts" in message and db.uri in message, message
        assert got == expected[: len(got)] and len(got) >= 120  # what did come was right
        db.close()
    finally:
        outage.close()
        databases.close()


def test_a_fit_whose_database_dies_fails_and_resumes_from_its_checkpoint_once_it_is_back(
    tiny: Path, pg_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data on PostgreSQL, metadata and artifacts elsewhere (SQLite, a folder), so the run
    can still be marked failed while the data database is gone."""
    from llmtrain.training import run as run_module

    fill(pg_uri, "docs", doc_rows(32))
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    db = lt.connect(
        pg_uri,
        metadata_uri=meta,
        artifacts=tmp_path / "artifacts",
        retry=RetryPolicy(attempts=3, base=0.01, cap=0.02),
    )
    options = {"max_steps": 12, "save_steps": 2, "cache_size": 4}

    traces: dict[str, KeyTrace] = {}

    def fit(name: str, trace: str, **kwargs: Any) -> Any:
        traces[trace] = KeyTrace()
        return trainer(tiny, name, **options).fit(
            X="instruction",
            Y="output",
            db=db,
            select=lt.Table("docs"),
            callbacks=[traces[trace]],
            **kwargs,
        )

    reference = fit("straight", "straight")

    outage = Outage("postgresql", pg_uri, monkeypatch)
    save = run_module.FitRun.save_checkpoint

    def database_dies_after_step_4(self: Any) -> Any:
        record = save(self)
        if self.step == 4:
            outage.start()
        return record

    monkeypatch.setattr(run_module.FitRun, "save_checkpoint", database_dies_after_step_4)
    try:
        with pytest.raises(DatabaseUnavailableError, match="failed after 3 attempts"):
            fit("outage", "first")
    finally:
        outage.close()
        monkeypatch.setattr(run_module.FitRun, "save_checkpoint", save)
    (run,) = db.metadata.list_runs("trainer", "outage")
    assert run.status == "failed" and "DatabaseUnavailableError" in (run.error or "")
    last_good = db.metadata.list_checkpoints(run.run_id)[-1].step
    assert last_good >= 4

    resumed = fit("outage", "resumed", resume=True)  # the database is back
    (run,) = db.metadata.list_runs("trainer", "outage")
    assert run.status == "completed" and resumed.record.run_id == run.run_id
    assert_same_weights(adapter(db, reference, tmp_path), adapter(db, resumed, tmp_path))

    def trace(name: str) -> list[tuple[int, list[str]]]:
        return [(e["step"], sorted(e["keys"])) for e in traces[name].steps]

    first, again = trace("first"), trace("resumed")
    assert again[0][0] == last_good + 1
    assert [e for e in first if e[0] <= last_good] + again == trace("straight")
