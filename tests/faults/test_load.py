"""Load and concurrency.

Promises: four processes adding versions of one component at once get unique, consecutive
versions and lose none (SQLite file, PostgreSQL); two trainers training at once into one
metadata store each leave a complete run, with every metric of every step, in order and
never mixed with the other run's; a million-row streaming read with a slow consumer keeps
no transaction (and so no cursor or snapshot) open on PostgreSQL between windows.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fill

import llmtrain as lt
from llmtrain.stores.metadata import open_metadata

from . import workers
from .helpers import admin_engine, database_name, doc_rows, fresh_any_database

pytestmark = pytest.mark.slow


@contextmanager
def running(procs: list[Any]) -> Iterator[None]:
    """Start the processes; afterwards join them, and end any that a failure left behind."""
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join(timeout=30)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from fresh_any_database(request.param, tmp_path)


def test_four_processes_adding_versions_at_once_get_unique_consecutive_ones(store_uri: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=workers.add_versions, args=(store_uri, barrier, queue, 10))
        for _ in range(4)
    ]
    with running(procs):
        results = dict(queue.get(timeout=180) for _ in procs)
    assert all(isinstance(v, list) for v in results.values()), results
    assert sorted(v for versions in results.values() for v in versions) == list(range(40))
    assert all(versions == sorted(versions) for versions in results.values())
    store = open_metadata(store_uri)
    stored = store.list_components("model", "shared")
    store.close()
    assert [r.version for r in stored] == list(range(40))
    by_version = {r.version: (r.payload["pid"], r.payload["i"]) for r in stored}
    for pid, versions in results.items():  # each version holds what its writer wrote
        assert [by_version[v] for v in versions] == [(pid, i) for i in range(10)]


def test_two_trainers_training_into_one_store_at_once_lose_and_mix_nothing(
    tiny: Path, tmp_path: Path
) -> None:
    steps = 6
    databases = [fresh_any_database(kind, tmp_path) for kind in ("sqlite", "postgresql")]
    uris = [next(d) for d in databases]
    try:
        for uri in uris:
            fill(uri, "docs", doc_rows(24))
        ctx = multiprocessing.get_context("spawn")
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        folders = [str(tmp_path / f"artifacts-{i}") for i in range(len(uris))]
        procs = [
            ctx.Process(
                target=workers.fit_at_once, args=(uris, folders, str(tiny), barrier, queue, steps)
            )
            for _ in range(2)
        ]
        with running(procs):
            results = [queue.get(timeout=400) for _ in range(2 * len(uris))]
        assert not [r for r in results if r[1] == "error"], results
        for uri in uris:
            _check_two_runs(uri, {r[1] for r in results if r[0] == uri}, steps)
    finally:
        for d in databases:
            d.close()


def _check_two_runs(uri: str, run_ids: set[str], steps: int) -> None:
    db = lt.connect(uri)
    runs = db.metadata.list_runs("trainer", "shared")
    assert {r.run_id for r in runs} == run_ids and len(run_ids) == 2
    trainer_versions = set(db.show("trainer", "shared"))
    for run in runs:
        assert run.status == "completed" and run.info["steps"] == steps
        assert run.version in trainer_versions  # the version it names was stored
        metrics = db.metadata.get_metrics(run.run_id)
        assert [m.step for m in metrics] == list(range(1, steps + 1))
        assert all(m.run_id == run.run_id and "loss" in m.values for m in metrics)
        checkpoints = db.metadata.list_checkpoints(run.run_id)
        assert [c.step for c in checkpoints][-1] == steps
    models = [db.load("model", "shared", v) for v in db.show("model", "shared")]
    assert sorted(m.version for m in models) == [0, 1]
    assert {m.record.run_id for m in models} == run_ids
    db.close()


def test_a_large_read_with_a_slow_consumer_holds_nothing_open_between_windows(
    pg_uri: str,
) -> None:
    rows, window = 300_000, 30_000  # ten windows, each a sizeable read
    admin = sa.create_engine(pg_uri, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(
            sa.text("CREATE TABLE docs (id integer PRIMARY KEY, instruction text, output text)")
        )
        conn.execute(
            sa.text(
                "INSERT INTO docs SELECT g, 'instruction ' || g, 'output ' || g "
                "FROM generate_series(0, :n - 1) g"
            ),
            {"n": rows},
        )
        conn.execute(sa.text("ANALYZE docs"))
    name = database_name(pg_uri)
    server = admin_engine("postgresql")
    samples: list[list[dict[str, Any]]] = []

    def sessions() -> list[dict[str, Any]]:
        with server.connect() as conn:
            return [
                dict(r)
                for r in conn.execute(
                    sa.text(
                        "SELECT pid, state, xact_start, backend_xmin, query FROM pg_stat_activity "
                        "WHERE datname = :d AND pid <> pg_backend_pid()"
                    ),
                    {"d": name},
                ).mappings()
            ]

    db = lt.connect(pg_uri)
    ds = lt.CachedQueryDataset(
        db, lt.Table("docs"), ["instruction", "output"], cache_size=window, seed=1, return_keys=True
    )
    seen = bytearray(rows)
    for i, row in enumerate(ds):
        seen[row["_key"]] += 1
        if i % window == window - 1:  # the consumer is slow: it dawdles after every window
            for _ in range(3):
                time.sleep(0.1)
                samples.append(sessions())
    db.close()
    server.dispose()
    admin.dispose()

    assert seen.count(1) == rows  # every row exactly once
    assert len(samples) == 3 * rows // window
    held = [
        s
        for sample in samples
        for s in sample
        if s["state"] in ("idle in transaction", "idle in transaction (aborted)")
        or (s["state"] == "idle" and (s["xact_start"] or s["backend_xmin"]))
    ]
    assert not held, held[:3]
    # the sampling did look at llmtrain's own (pooled, idle) session
    assert any(s["state"] == "idle" for sample in samples for s in sample)
