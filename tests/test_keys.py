"""Keys: every type the databases order pages correctly on every backend, across a resume,
and a key that is not unique is refused instead of delivering rows twice or not at all."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from bson import ObjectId
from conftest import fill, fresh_database

import llmtrain as lt
from llmtrain.data.snapshot import MemoryStore, take_snapshot
from llmtrain.db.engines import mongo_database, sql_engine
from llmtrain.db.keys import key_repr
from llmtrain.errors import ConfigError

N = 50


def _binary() -> Any:
    return sa.LargeBinary().with_variant(sa.VARBINARY(16), "mysql", "mariadb")


# name -> (column type, key of row i); keys are inserted in an order unlike their sort order
KEY_TYPES: dict[str, tuple[Callable[[], Any], Callable[[int], Any]]] = {
    "integer": (sa.Integer, lambda i: (i * 7919) % 1009 - 500),
    "bigint": (sa.BigInteger, lambda i: 2**40 + (i * 7919) % 1009),
    "text": (lambda: sa.String(40), lambda i: f"k{(i * 37) % 101:03d}-{i}"),
    "uuid": (sa.Uuid, lambda i: uuid.UUID(int=(i * 0x9E3779B97F4A7C15) % 2**128)),
    "date": (sa.Date, lambda i: dt.date(2020, 1, 1) + dt.timedelta(days=(i * 37) % 400)),
    "timestamp": (
        sa.DateTime,
        lambda i: dt.datetime(2024, 5, 1, 12) + dt.timedelta(seconds=(i * 7919) % 100_000),
    ),
    "bytes": (_binary, lambda i: bytes([(i * 37) % 256, i % 7, 0, 255 - i])),
}


def _make_table(uri: str, kind: str) -> None:
    column_type, make_key = KEY_TYPES[kind]
    table = sa.Table(
        "docs",
        sa.MetaData(),
        sa.Column("k", column_type(), primary_key=True, autoincrement=False),
        sa.Column("text", sa.Text),
    )
    engine = sql_engine(uri, create=True)
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"k": make_key(i), "text": f"row {i}"} for i in range(N)])


def _dataset(db: Any, query: lt.Query, **kw: Any) -> lt.CachedQueryDataset:
    kw = {"cache_size": 8, "seed": 3, "rank": 0, "world_size": 1, **kw}
    return lt.CachedQueryDataset(db, query, "text", return_keys=True, **kw)


def _check_epoch_and_resume(db: Any, query: lt.Query) -> None:
    """A full epoch delivers every row once (also split over two ranks, which reads by key),
    and a state taken mid-window, sent through JSON, continues exactly."""
    full = list(_dataset(db, query))
    assert sorted(r["text"] for r in full) == sorted(f"row {i}" for i in range(N))
    ranks = [list(_dataset(db, query, rank=r, world_size=2, cache_size=7)) for r in (0, 1)]
    assert sorted(r["text"] for rows in ranks for r in rows) == sorted(r["text"] for r in full)

    ds = _dataset(db, query)
    it = iter(ds)
    head = [next(it) for _ in range(21)]
    del it  # stops mid-window
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = _dataset(db, query)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full

    for row in full:  # keys come back as plain values with a stable text form
        assert "0x" not in key_repr(row["_key"])
    again = _dataset(db, query)
    assert again.data_fingerprint == ds.data_fingerprint


@pytest.mark.parametrize("kind", list(KEY_TYPES))
def test_every_key_type_pages_and_resumes(sql_uri: str, kind: str) -> None:
    _make_table(sql_uri, kind)
    db = lt.connect(sql_uri)
    _check_epoch_and_resume(db, lt.Table("docs"))
    store = MemoryStore()
    held = take_snapshot(db, lt.Table("docs"), eval_fraction=0.3, chunk_size=5, store=store)
    assert held.count == N and held.train.count + held.held.count == N  # type: ignore[union-attr]
    assert held == take_snapshot(db, lt.Table("docs"), eval_fraction=0.3, chunk_size=5, store=store)
    view = _dataset(
        db, lt.Table("docs"), split="held_out", eval_fraction=0.3, snapshot=held, store=store
    )
    assert len(list(view)) == held.held.count  # type: ignore[union-attr]


def test_mixed_bson_id_types_page_in_mongodb_order() -> None:
    uri = f"mongomock://localhost/lt_{uuid.uuid4().hex[:12]}"
    ids: list[Any] = [*range(2, 22, 2), 7.5, -3, *[f"s{i}" for i in range(12)], "", "Z"]
    ids += [ObjectId(f"{i:024x}") for i in range(1, 13)]
    ids += [dt.datetime(2024, 1, d) for d in range(1, 9)]
    ids += [{"a": 1}, {"a": 2}, True, False]
    assert len(ids) == N
    coll = mongo_database(uri)["docs"]
    coll.insert_many([{"_id": k, "text": f"row {i}"} for i, k in enumerate(ids)])
    db = lt.connect(uri)
    store = MemoryStore()
    snapshot = take_snapshot(db, lt.Collection("docs"), chunk_size=8, store=store)
    keys = list(snapshot.train.iter_keys(store))
    assert len(keys) == snapshot.count == N and keys[0] == -3
    assert keys[-1] == dt.datetime(2024, 1, 8) and sorted(map(repr, keys)) == sorted(map(repr, ids))
    _check_epoch_and_resume(db, lt.Collection("docs"))
    keys = [k for k, _ in db.backend.fetch_rows(lt.Collection("docs"), (), 20, 100)]
    assert keys[0] == 20 and keys[1] == "" and keys[-1] == dt.datetime(2024, 1, 8)


def test_object_ids_page_and_resume() -> None:
    uri = f"mongomock://localhost/lt_{uuid.uuid4().hex[:12]}"
    coll = mongo_database(uri)["docs"]
    coll.insert_many([{"_id": ObjectId(), "text": f"row {i}"} for i in range(N)])
    _check_epoch_and_resume(lt.connect(uri), lt.Collection("docs"))


def _two_parts_per_doc(uri: str) -> None:
    """The issue's table: primary key (doc_id, part), 50 documents, 10 of them in two parts."""
    table = sa.Table(
        "parts",
        sa.MetaData(),
        sa.Column("doc_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("part", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("text", sa.Text),
    )
    engine = sql_engine(uri, create=True)
    table.create(engine)
    rows = [
        {"doc_id": d, "part": p, "text": f"{d}/{p}"}
        for d in range(50)
        for p in (0, 1)
        if p == 0 or d < 10
    ]
    with engine.begin() as conn:
        conn.execute(table.insert(), rows)


@pytest.mark.parametrize("eval_fraction", [0.0, 0.2])
def test_a_key_that_is_not_unique_is_refused(sql_uri: str, eval_fraction: float) -> None:
    _two_parts_per_doc(sql_uri)
    db = lt.connect(sql_uri)
    query = lt.Table("parts", key="doc_id")
    with pytest.raises(lt.QueryError, match="table parts: key column 'doc_id'.*(not unique|more)"):
        len(_dataset(db, query, eval_fraction=eval_fraction, split="train"))
    raw = lt.sql("SELECT doc_id, text FROM parts", key="doc_id")
    with pytest.raises(lt.QueryError, match="key column 'doc_id'"):
        len(_dataset(db, raw, eval_fraction=eval_fraction, split="train"))
    unique = lt.sql("SELECT doc_id * 10 + part AS k, text FROM parts", key="k")
    assert len(_dataset(db, unique, eval_fraction=eval_fraction, split="all")) == 60


def test_a_composite_primary_key_says_what_to_do(sql_uri: str) -> None:
    _two_parts_per_doc(sql_uri)
    db = lt.connect(sql_uri)
    message = r"composite primary key \['doc_id', 'part'\].*key=.*llmtrain.sql"
    with pytest.raises(lt.QueryError, match=message):
        len(_dataset(db, lt.Table("parts")))


def test_a_null_key_is_refused(sql_uri: str) -> None:
    fill(sql_uri, "docs", [{"id": i, "text": f"row {i}", "g": i % 5 or None} for i in range(20)])
    db = lt.connect(sql_uri)
    query = lt.sql("SELECT g, text FROM docs WHERE id < 6", key="g")
    with pytest.raises(lt.QueryError, match="key column 'g' holds NULL"):
        len(_dataset(db, query))


def test_a_key_longer_than_any_key_is_refused_before_it_is_recorded(tmp_path: Any) -> None:
    """A 5 MB text key named to forget() or trained_on() is refused in one line, not written
    into a forget record; a long key that can exist (4,096 characters) is looked up."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    with sql_engine(uri, create=True).begin() as conn:
        conn.execute(sa.text("CREATE TABLE docs (id TEXT PRIMARY KEY, text TEXT)"))
        conn.execute(sa.text("INSERT INTO docs VALUES ('k0', 'x'), ('k1', 'y')"))
    db = lt.connect(uri)
    huge = "k" * 5_000_000
    for call, keys in ((db.forget, [huge]), (db.trained_on, huge)):
        with pytest.raises(ConfigError, match=r"^\w+\(\): a key of 5000000 characters \(at most"):
            call("docs", keys)
    assert db.metadata.list_components() == [] and not db.trained_on("docs", "k" * 4096).runs


def test_a_nan_key_is_refused_not_read_twice(tmp_path: Any) -> None:
    """PostgreSQL sorts NaN above every number and finds it equal to itself; Python does
    not, so a page starting at a NaN would read its row again. Both readers refuse it."""
    databases = fresh_database("postgresql", tmp_path)
    uri = next(databases)
    try:
        engine = sa.create_engine(uri)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id double precision PRIMARY KEY, x text)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1, 'a'), (2, 'b'), ('NaN', 'n')"))
        engine.dispose()
        db = lt.connect(uri)
        with pytest.raises(lt.QueryError, match="key column 'id' holds NaN"):
            list(lt.QueryDataset(db, lt.Table("t"), ["x"], page_size=2))
        with pytest.raises(lt.QueryError, match="key column 'id' holds NaN"):
            len(_dataset(db, lt.Table("t")))
        db.close()
    finally:
        databases.close()


def test_the_split_is_a_recorded_pure_function_of_the_key(tmp_path: Any) -> None:
    """Each key's side of the held-out split is held_out(key, fraction), whatever the page it
    was read in; a record split by another rule is refused rather than read differently."""
    from llmtrain.data.snapshot import MemoryStore, RunSnapshot
    from llmtrain.db.keys import DIGEST, held_out

    uri = f"sqlite:///{tmp_path / 'split.db'}"
    _make_table(uri, "text")
    db = lt.connect(uri)
    store = MemoryStore()
    snapshot = take_snapshot(db, lt.Table("docs"), eval_fraction=0.3, chunk_size=7, store=store)
    assert snapshot.held is not None
    held = set(snapshot.held.keys(store, 0, snapshot.held.count))
    train = set(snapshot.train.keys(store, 0, snapshot.train.count))
    assert held and train and not held & train
    assert all(held_out(k, 0.3) for k in held) and not any(held_out(k, 0.3) for k in train)
    record = snapshot.to_record()
    assert record["split"] == DIGEST and RunSnapshot.from_record(record) == snapshot
    with pytest.raises(ConfigError, match="rule 'sha256-prefix-0'"):
        RunSnapshot.from_record({**record, "split": "sha256-prefix-0"})
    db.close()
