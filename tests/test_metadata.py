"""The metadata store on every backend: SQLite file, PostgreSQL, MariaDB and mongomock."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import SQL_BACKENDS, fill, fresh_database

from llmtrain.db.engines import dispose_sql_engine
from llmtrain.errors import ComponentNotFoundError, StoreError
from llmtrain.stores.metadata import MetadataStore, open_metadata
from llmtrain.stores.metadata.mongo import MongoMetadataStore
from llmtrain.stores.metadata.sql import SQLMetadataStore
from llmtrain.uri import is_mongo_uri

OUR_TABLES = {
    "_llmtrain_components",
    "_llmtrain_runs",
    "_llmtrain_metrics",
    "_llmtrain_checkpoints",
}


@pytest.fixture
def store(any_uri: str) -> Iterator[MetadataStore]:
    store = open_metadata(any_uri)
    yield store
    store.close()


def table_names(uri: str) -> set[str]:
    if is_mongo_uri(uri):
        from llmtrain.db.engines import mongo_database

        return set(mongo_database(uri).list_collection_names())
    from llmtrain.db.engines import sql_engine

    return set(sa.inspect(sql_engine(uri)).get_table_names())


def recent(moment: datetime) -> bool:
    return (
        moment.tzinfo is not None
        and moment.utcoffset() == timedelta(0)
        and abs(datetime.now(timezone.utc) - moment) < timedelta(minutes=5)
    )


# -- components ---------------------------------------------------------------------------------
def test_open_metadata_picks_the_backend(any_uri: str) -> None:
    expected = MongoMetadataStore if is_mongo_uri(any_uri) else SQLMetadataStore
    assert type(open_metadata(any_uri)) is expected


def test_versions_count_from_zero_and_newest_is_default(store: MetadataStore) -> None:
    assert [store.add_component("model", "m1", {"n": i}) for i in range(3)] == [0, 1, 2]
    assert store.add_component("model", "other", {}) == 0
    newest = store.get_component("model", "m1")
    assert (newest.version, newest.payload) == (2, {"n": 2})
    old = store.get_component("model", "m1", 1)
    assert (old.type_id, old.identifier, old.version, old.payload) == ("model", "m1", 1, {"n": 1})
    assert recent(old.created_at)


def test_payload_round_trips_exactly(store: MetadataStore) -> None:
    payload = {
        "text": "héllo ✓ 日本語 🤖",
        "nested": {"a": [1, 2.5, None, True]},
        "mongo_query": {"$match": {"a.b": {"$gt": 1}}},
        "big": "x" * 200_000,
    }
    version = store.add_component("dataset", "ds", payload)
    assert store.get_component("dataset", "ds", version).payload == payload


def test_bad_payload_is_refused(store: MetadataStore) -> None:
    with pytest.raises(StoreError, match="not JSON-serialisable"):
        store.add_component("model", "m", {"obj": object()})
    with pytest.raises(StoreError, match="must be a dict"):
        store.add_component("model", "m", [1, 2])  # type: ignore[arg-type]
    assert store.list_components() == []


def test_missing_component_error_names_what_was_asked(store: MetadataStore) -> None:
    with pytest.raises(ComponentNotFoundError, match=r"model 'nope' \(any version\)"):
        store.get_component("model", "nope")
    store.add_component("model", "m", {})
    with pytest.raises(ComponentNotFoundError, match=r"model 'm' \(version 7\)") as info:
        store.get_component("model", "m", 7)
    assert isinstance(info.value, KeyError) and isinstance(info.value, StoreError)
    assert "version 7" in str(info.value)


def test_list_orders_and_filters(store: MetadataStore) -> None:
    for type_id, identifier in [
        ("model", "b"),
        ("dataset", "z"),
        ("model", "a"),
        ("model", "b"),
        ("model", "B"),
    ]:
        store.add_component(type_id, identifier, {"t": type_id})
    listed = [(r.type_id, r.identifier, r.version) for r in store.list_components()]
    assert listed == [
        ("dataset", "z", 0),
        ("model", "B", 0),
        ("model", "a", 0),
        ("model", "b", 0),
        ("model", "b", 1),
    ]
    assert [r.identifier for r in store.list_components("model")] == ["B", "a", "b", "b"]
    assert [r.version for r in store.list_components("model", "b")] == [0, 1]
    assert [r.type_id for r in store.list_components(identifier="z")] == ["dataset"]
    assert store.list_components("nothing") == []


def test_identifiers_are_case_sensitive(store: MetadataStore) -> None:
    """MariaDB's default collation would merge these; the tables use a binary one."""
    assert store.add_component("model", "Foo", {"v": "upper"}) == 0
    assert store.add_component("model", "foo", {"v": "lower"}) == 0
    assert store.add_component("model", "foo ", {"v": "space"}) == 0
    assert store.get_component("model", "Foo").payload == {"v": "upper"}
    assert store.get_component("model", "foo").payload == {"v": "lower"}


def test_remove_one_version_or_all(store: MetadataStore) -> None:
    for i in range(3):
        store.add_component("model", "m", {"i": i})
    store.add_component("model", "keep", {})
    assert store.remove_component("model", "m", 1) == 1
    assert [r.version for r in store.list_components("model", "m")] == [0, 2]
    assert store.remove_component("model", "m", 1) == 0
    assert store.add_component("model", "m", {}) == 3  # max + 1, never reusing 2
    assert store.remove_component("model", "m") == 3
    with pytest.raises(ComponentNotFoundError):
        store.get_component("model", "m")
    assert [r.identifier for r in store.list_components()] == ["keep"]


# -- runs, metrics, checkpoints -----------------------------------------------------------------
def test_run_lifecycle(store: MetadataStore) -> None:
    created = store.create_run("r1", "trainer", "t", 2, {"seed": 1, "lr": 0.1})
    assert (created.status, created.info, created.error) == (
        "created",
        {"seed": 1, "lr": 0.1},
        None,
    )
    assert recent(created.created_at) and created.updated_at == created.created_at
    assert store.get_run("r1") == created
    updated = store.update_run("r1", status="running", info={"lr": 0.2, "host": "a"})
    assert updated.info == {"seed": 1, "lr": 0.2, "host": "a"}
    assert updated.updated_at >= created.updated_at
    failed = store.update_run("r1", status="failed", error="OOM at step 3")
    assert (failed.status, failed.error, failed.info["host"]) == ("failed", "OOM at step 3", "a")
    assert store.get_run("r1") == failed


def test_run_errors(store: MetadataStore) -> None:
    store.create_run("r1", "trainer", "t", 0, {})
    with pytest.raises(StoreError, match="'r1' already exists"):
        store.create_run("r1", "trainer", "t", 0, {})
    with pytest.raises(StoreError, match="no run 'nope'"):
        store.get_run("nope")
    with pytest.raises(StoreError, match="no run 'nope'"):
        store.update_run("nope", status="running")
    with pytest.raises(StoreError, match="status 'done' is invalid"):
        store.update_run("r1", status="done")  # type: ignore[arg-type]
    assert store.get_run("r1").status == "created"


def test_list_runs_oldest_first(store: MetadataStore) -> None:
    for run_id, identifier in [("z", "a"), ("y", "b"), ("x", "a")]:
        store.create_run(run_id, "trainer", identifier, 0, {})
    assert [r.run_id for r in store.list_runs()] == ["z", "y", "x"]
    assert [r.run_id for r in store.list_runs("trainer", "a")] == ["z", "x"]
    assert store.list_runs("other") == []


def test_concurrent_run_updates_merge_every_key(store: MetadataStore) -> None:
    store.create_run("r", "trainer", "t", 0, {})

    def work(k: int) -> None:
        for i in range(5):
            store.update_run("r", info={f"w{k}_{i}": i})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.get_run("r").info) == 20


def test_metrics_by_step_then_insertion(store: MetadataStore) -> None:
    store.log_metrics("r", 2, {"loss": 0.5})
    store.log_metrics("r", 1, {"loss": 1.0, "lr": 1})
    store.log_metrics("r", 2, {"eval_loss": 0.7})
    store.log_metrics("other", 0, {"loss": 9.0})
    got = store.get_metrics("r")
    assert [(m.step, m.values) for m in got] == [
        (1, {"loss": 1.0, "lr": 1.0}),
        (2, {"loss": 0.5}),
        (2, {"eval_loss": 0.7}),
    ]
    assert all(m.run_id == "r" and recent(m.created_at) for m in got)
    assert isinstance(got[0].values["lr"], float)
    with pytest.raises(StoreError, match="dict of numbers"):
        store.log_metrics("r", 3, {"loss": "high"})  # type: ignore[dict-item]


def test_metrics_keep_nan_and_inf(store: MetadataStore) -> None:
    store.log_metrics("r", 0, {"loss": float("nan"), "grad": float("inf")})
    values = store.get_metrics("r")[0].values
    assert values["loss"] != values["loss"] and values["grad"] == float("inf")


def test_checkpoints(store: MetadataStore) -> None:
    for step in (20, 10, 30):
        record = store.add_checkpoint("r", step, f"tree:{step:064x}", {"loss": step / 10})
        assert record.step == step and recent(record.created_at)
    store.add_checkpoint("other", 10, "tree:" + "0" * 64, {})
    listed = store.list_checkpoints("r")
    assert [(c.step, c.artifact_id, c.info) for c in listed] == [
        (s, f"tree:{s:064x}", {"loss": s / 10}) for s in (10, 20, 30)
    ]
    with pytest.raises(StoreError, match="already has a checkpoint at step 20"):
        store.add_checkpoint("r", 20, "tree:" + "1" * 64, {})
    store.remove_checkpoint("r", 20)
    store.remove_checkpoint("r", 20)  # already gone: no-op
    assert [c.step for c in store.list_checkpoints("r")] == [10, 30]
    assert [c.step for c in store.list_checkpoints("other")] == [10]


def test_a_none_id_finds_and_removes_nothing(store: MetadataStore) -> None:
    """Only the optional filters (list_*, a component's version) may be left out; None in
    a required id matches no record, so a bug upstream cannot read or wipe every run."""
    store.add_component("model", "m", {})
    store.create_run("r1", "trainer", "t", 0, {})
    store.add_checkpoint("r1", 10, "tree:" + "0" * 64, {})
    store.log_metrics("r1", 10, {"loss": 1.0})
    none: Any = None
    with pytest.raises(StoreError, match="no run None"):
        store.get_run(none)
    with pytest.raises(ComponentNotFoundError):
        store.get_component("model", none)
    assert store.list_checkpoints(none) == [] and store.get_metrics(none) == []
    store.remove_checkpoint("r1", none)
    store.remove_run(none)
    assert store.remove_component("model", none) == 0
    assert [c.step for c in store.list_checkpoints("r1")] == [10]
    assert len(store.get_metrics("r1")) == 1 and store.get_run("r1").run_id == "r1"
    assert [r.identifier for r in store.list_components()] == ["m"]
    assert [r.run_id for r in store.list_runs()] == ["r1"]


# -- schema ---------------------------------------------------------------------------------------
def test_schema_is_created_once_and_user_tables_are_untouched(any_uri: str) -> None:
    rows = [{"id": i, "text": f"doc {i}"} for i in range(5)]
    fill(any_uri, "docs", rows)
    first = open_metadata(any_uri)
    first.add_component("model", "m", {"a": 1})
    second = open_metadata(any_uri)  # a second store checks the schema again: no error
    assert second.add_component("model", "m", {"a": 2}) == 1
    assert [r.payload for r in first.list_components()] == [{"a": 1}, {"a": 2}]
    assert table_names(any_uri) >= OUR_TABLES | {"docs"}
    assert {t for t in table_names(any_uri) if not t.startswith("_llmtrain_")} <= {
        "docs",
        "system.indexes",
    }
    assert read_docs(any_uri) == rows
    first.close()
    second.close()


def read_docs(uri: str) -> list[dict[str, Any]]:
    if is_mongo_uri(uri):
        from llmtrain.db.engines import mongo_database

        docs = mongo_database(uri)["docs"].find().sort("_id", 1)
        return [{"id": d["_id"], "text": d["text"]} for d in docs]
    from llmtrain.db.engines import sql_engine

    with sql_engine(uri).connect() as conn:
        result = conn.execute(sa.text("SELECT id, text FROM docs ORDER BY id"))
        return [dict(r) for r in result.mappings()]


def test_store_reopens_after_close(store: MetadataStore) -> None:
    store.add_component("model", "m", {})
    store.close()
    assert store.add_component("model", "m", {}) == 1


# -- concurrency ----------------------------------------------------------------------------------
def test_concurrent_threads_get_unique_consecutive_versions(store: MetadataStore) -> None:
    results: list[list[int]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def work(k: int) -> None:
        barrier.wait()
        for i in range(10):
            results[k].append(store.add_component("model", "shared", {"k": k, "i": i}))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    returned = sorted(v for r in results for v in r)
    assert returned == list(range(40))
    assert all(r == sorted(r) for r in results)  # each writer sees its versions grow
    stored = store.list_components("model", "shared")
    assert [r.version for r in stored] == list(range(40))
    by_version = {r.version: (r.payload["k"], r.payload["i"]) for r in stored}
    assert all(by_version[v] == (k, i) for k, r in enumerate(results) for i, v in enumerate(r))


def _add_in_process(uri: str, barrier: Any, queue: Any) -> None:
    store = open_metadata(uri)
    try:
        barrier.wait(timeout=60)
        queue.put([store.add_component("model", "shared", {}) for _ in range(10)])
    except BaseException as exc:  # noqa: BLE001 - report it to the parent
        queue.put(repr(exc))
    finally:
        store.close()


@pytest.mark.parametrize("kind", SQL_BACKENDS)
def test_concurrent_processes_get_unique_consecutive_versions(kind: str, tmp_path: Any) -> None:
    """Two fresh processes race from an empty database: schema creation and versions."""
    databases = fresh_database(kind, tmp_path)
    uri = next(databases)
    try:
        ctx = multiprocessing.get_context("spawn")
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_add_in_process, args=(uri, barrier, queue)) for _ in range(2)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert all(isinstance(r, list) for r in results), results
        assert sorted(v for r in results for v in r) == list(range(20))
        store = open_metadata(uri)
        assert [r.version for r in store.list_components("model", "shared")] == list(range(20))
        store.close()
    finally:
        databases.close()


def test_mariadb_scheme_gets_the_binary_collation_too(tmp_path: Any) -> None:
    """``mariadb://`` selects a dialect that ignores ``mysql_*`` table options."""
    databases = fresh_database("mariadb", tmp_path)
    uri = next(databases).replace("mysql+pymysql://", "mariadb+pymysql://", 1)
    try:
        store = open_metadata(uri)
        assert [store.add_component("model", i, {}) for i in ("a", "A", "a ")] == [0, 0, 0]
        store.close()
    finally:
        dispose_sql_engine(uri)
        databases.close()


def test_store_pickles_as_its_uri(store: MetadataStore) -> None:
    store.add_component("model", "m", {"a": 1})
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_component("model", "m").payload == {"a": 1}


def test_a_run_that_completes_after_failing_has_no_error(any_uri: str) -> None:
    from llmtrain.stores.metadata import open_metadata

    store = open_metadata(any_uri)
    store.create_run("r1", "trainer", "t", 0, {})
    assert store.update_run("r1", status="failed", error="boom").error == "boom"
    assert store.update_run("r1", status="running").error is None
    store.update_run("r1", status="failed", error="again")
    assert store.update_run("r1", info={"x": 1}).error == "again"
    assert store.update_run("r1", status="completed").error is None
