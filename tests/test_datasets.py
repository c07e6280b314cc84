"""QueryDataset and CachedQueryDataset on every real backend: sharding, order, resume,
bad rows, and how many rows each rank actually fetched."""

from __future__ import annotations

import collections
from typing import Any

import pytest
from conftest import fill

import llmtrain as lt
from llmtrain.errors import BadRowError, ConfigError, DataChangedError


def _rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "instruction": f"instr {i}",
            "output": f"out {i}",
            "lang": "en" if i % 4 else "fr",
        }
        for i in range(start, start + n)
    ]


def _select(uri: str, **filters: Any) -> lt.Query:
    if uri.startswith("mongo"):
        return lt.Collection("docs").find(filters or None)
    table = lt.Table("docs")
    for name, value in filters.items():
        table = table.where(f"{name} = :{name}", **{name: value})
    return table


def _keys(rows: list[dict[str, Any]]) -> list[Any]:
    return [r["_key"] for r in rows]


def _dataset(db: Any, uri: str, **kwargs: Any) -> lt.CachedQueryDataset:
    kwargs.setdefault("cache_size", 16)
    return lt.CachedQueryDataset(
        db,
        kwargs.pop("select", _select(uri)),
        ["instruction", "output"],
        return_keys=True,
        **kwargs,
    )


def test_shards_are_disjoint_equal_and_fetched_exactly(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(203))
    db = lt.connect(any_uri)
    per_rank = []
    for rank in range(3):
        ds = _dataset(db, any_uri, rank=rank, world_size=3, seed=7)
        rows = list(ds)
        assert len(rows) == len(ds) == 203 // 3
        # each rank fetched its own rows and nothing else
        assert ds.stats.rows_fetched == len(rows)
        per_rank.append(_keys(rows))
        for r in rows:
            assert r["instruction"] == f"instr {r['_key']}"
    union = collections.Counter(k for keys in per_rank for k in keys)
    assert max(union.values()) == 1
    assert len(union) == 203 - 203 % 3


def test_filter_is_applied(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(100))
    db = lt.connect(any_uri)
    ds = _dataset(db, any_uri, select=_select(any_uri, lang="fr"), rank=0, world_size=1)
    assert sorted(_keys(list(ds))) == list(range(0, 100, 4))


def test_order_is_seeded_and_changes_per_epoch(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(100))
    db = lt.connect(any_uri)
    a = _dataset(db, any_uri, seed=3, rank=0, world_size=1)
    b = _dataset(db, any_uri, seed=3, rank=0, world_size=1)
    first = _keys(list(a))
    assert first == _keys(list(b))
    assert first != sorted(first)  # shuffled
    a.set_epoch(1)
    second = _keys(list(a))
    assert sorted(second) == sorted(first) and second != first
    # a completed pass moves on by itself: the next pass is epoch 2, not a replay
    third = _keys(list(a))
    assert a.epoch == 2 and third not in (first, second)
    unshuffled = _dataset(db, any_uri, shuffle=False, rank=0, world_size=1)
    assert _keys(list(unshuffled)) == sorted(first)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_at_next_row(any_uri: str, num_workers: int) -> None:
    fill(any_uri, "docs", _rows(150))
    db = lt.connect(any_uri)
    full = [
        k
        for batch in _dataset(db, any_uri, seed=1, rank=1, world_size=2).loader(
            4, num_workers=num_workers
        )
        for k in _keys(batch)
    ]
    assert len(full) == 75

    ds = _dataset(db, any_uri, seed=1, rank=1, world_size=2)
    loader = ds.loader(4, num_workers=num_workers)
    first: list[Any] = []
    for batch in loader:
        first += _keys(batch)
        if len(first) >= 28:
            break
    state = loader.state_dict()
    assert state["consumed"] == 28

    # resume with another worker count, in a fresh dataset: exactly the rest, read once
    fresh = _dataset(db, any_uri, seed=1, rank=1, world_size=2)
    fresh.load_state_dict(state)
    other_workers = 1 if num_workers == 0 else 0
    rest: list[Any] = []
    second_loader = fresh.loader(4, num_workers=other_workers)
    for batch in second_loader:
        rest += _keys(batch)
        if len(rest) >= 20:
            break
    state2 = second_loader.state_dict()
    assert first + rest == full[:48]
    if other_workers == 0:
        assert fresh.stats.rows_fetched <= 75 - 28  # consumed rows were not read again

    # resume a second time
    third = _dataset(db, any_uri, seed=1, rank=1, world_size=2)
    third.load_state_dict(state2)
    tail = [k for batch in third.loader(4) for k in _keys(batch)]
    assert first + rest + tail == full


def test_resume_exactly_at_epoch_boundary(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(40))
    db = lt.connect(any_uri)
    ds = _dataset(db, any_uri, seed=5, rank=0, world_size=1)
    ds.set_epoch(0)
    epoch0 = _keys(list(ds))
    state = ds.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)

    reference = _dataset(db, any_uri, seed=5, rank=0, world_size=1)
    reference.set_epoch(1)
    epoch1 = _keys(list(reference))

    resumed = _dataset(db, any_uri, seed=5, rank=0, world_size=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert _keys(list(resumed)) == epoch1 != epoch0


def test_state_loaded_after_iter_is_honoured(sqlite_uri: str) -> None:
    fill(sqlite_uri, "docs", _rows(30))
    db = lt.connect(sqlite_uri)
    ds = _dataset(db, sqlite_uri, rank=0, world_size=1)
    full = _keys(list(_dataset(db, sqlite_uri, rank=0, world_size=1)))
    state = {**ds.state_dict(), "consumed": 10}
    it = iter(ds)
    ds.load_state_dict(state)
    assert _keys(list(it)) == full[10:]


def test_changed_rows_refuse_resume_unless_allowed(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(50))
    db = lt.connect(any_uri)
    ds = _dataset(db, any_uri, rank=0, world_size=1)
    it = iter(ds)
    for _ in range(10):
        next(it)
    state = ds.state_dict()
    fill(any_uri, "docs", _rows(5, start=1000)) if any_uri.startswith("mongo") else _insert_sql(
        any_uri, 1000
    )
    fresh = _dataset(db, any_uri, rank=0, world_size=1)
    with pytest.raises(DataChangedError, match="row count 50 -> 5[15]"):
        fresh.load_state_dict(state)
    fresh.load_state_dict(state, allow_changed_data=True)
    assert fresh.state_dict()["consumed"] == 10


def _insert_sql(uri: str, key: int) -> None:
    import sqlalchemy as sa

    from llmtrain.db.engines import sql_engine

    with sql_engine(uri).begin() as conn:
        conn.execute(
            sa.text("INSERT INTO docs (id, instruction, output, lang) VALUES (:i, 'x', 'y', 'en')"),
            {"i": key},
        )


def test_resume_refuses_a_different_layout(sqlite_uri: str) -> None:
    fill(sqlite_uri, "docs", _rows(20))
    db = lt.connect(sqlite_uri)
    state = _dataset(db, sqlite_uri, rank=0, world_size=2).state_dict()
    with pytest.raises(ConfigError, match="world_size=2"):
        _dataset(db, sqlite_uri, rank=0, world_size=4).load_state_dict(state)


def test_bad_rows_raise_with_row_and_field_or_are_skipped(any_uri: str) -> None:
    rows = _rows(20)
    rows[3]["output"] = None
    rows[7]["instruction"] = 42 if any_uri.startswith("mongo") else None
    fill(any_uri, "docs", rows)
    db = lt.connect(any_uri)
    ds = _dataset(db, any_uri, shuffle=False, rank=0, world_size=1)
    with pytest.raises(BadRowError) as err:
        list(ds)
    assert err.value.key == 3 and err.value.field == "output"
    assert "docs" in str(err.value) and "'output' is null" in str(err.value)

    skipping = _dataset(db, any_uri, shuffle=False, on_bad_row="skip", rank=0, world_size=1)
    keys = _keys(list(skipping))
    assert keys == [k for k in range(20) if k not in (3, 7)]
    assert skipping.stats.skipped == 2 and skipping.stats.skipped_keys == [3, 7]


def test_mongo_nested_fields_and_missing(tmp_path: Any) -> None:
    uri = "mongomock://localhost/nested"
    from llmtrain.db.engines import mongo_database

    coll = mongo_database(uri)["chats"]
    coll.insert_many(
        [{"_id": i, "meta": {"prompt": f"p{i}"}, "answer": f"a{i}"} for i in range(10)]
        + [{"_id": 10, "meta": {}, "answer": "x"}]
    )
    db = lt.connect(uri)
    ds = lt.CachedQueryDataset(
        db,
        lt.Collection("chats").find(),
        ["meta.prompt", "answer"],
        shuffle=False,
        rank=0,
        world_size=1,
    )
    it = iter(ds)
    assert next(it) == {"meta.prompt": "p0", "answer": "a0"}
    with pytest.raises(BadRowError, match="key 10.*'meta.prompt' is missing"):
        list(it)


def test_query_dataset_reads_all(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(57))
    db = lt.connect(any_uri)
    ds = lt.QueryDataset(db, _select(any_uri, lang="en"), ["instruction"], page_size=10)
    assert len(ds) == 57 - 15
    assert ds[0] == {"instruction": "instr 1"}
    assert ds.stats.rows_fetched == len(ds)


def test_table_without_unique_key_is_a_clear_error(sqlite_uri: str) -> None:
    import sqlalchemy as sa

    from llmtrain.db.engines import sql_engine

    with sql_engine(sqlite_uri, create=True).begin() as conn:
        conn.execute(sa.text("CREATE TABLE nokey (a TEXT, b TEXT)"))
    db = lt.connect(sqlite_uri)
    with pytest.raises(lt.QueryError, match="no primary key.*key='column'"):
        len(lt.CachedQueryDataset(db, lt.Table("nokey"), ["a"]))


def test_raw_sql_join(sql_uri: str) -> None:
    fill(sql_uri, "docs", _rows(30))
    fill(sql_uri, "labels", [{"id": i, "label": f"L{i}"} for i in range(0, 30, 2)])
    db = lt.connect(sql_uri)
    query = lt.sql(
        "SELECT d.id AS doc_id, d.instruction, l.label FROM docs d "
        "JOIN labels l ON l.id = d.id WHERE d.lang = :lang",
        key="doc_id",
        lang="en",
    )
    ds = lt.CachedQueryDataset(
        db,
        query,
        ["instruction", "label"],
        shuffle=False,
        return_keys=True,
        cache_size=4,
        rank=0,
        world_size=1,
    )
    rows = list(ds)
    assert _keys(rows) == [i for i in range(0, 30, 2) if i % 4]
    assert rows[0] == {"instruction": "instr 2", "label": "L2", "_key": 2}


def test_sql_text_may_end_in_a_comment_and_sqlite_names_any_case(sql_uri: str) -> None:
    """A query or filter ending in ``-- comment`` (it swallowed what llmtrain wraps around it);
    on SQLite, whose names are case-insensitive, lt.Table("DOCS") reads table docs."""
    fill(sql_uri, "docs", _rows(10))
    db = lt.connect(sql_uri)
    queries = [
        lt.sql("SELECT id, instruction FROM docs -- every row", key="id"),
        lt.Table("docs").where("id < :n -- the first ones", n=5),
    ]
    if sql_uri.startswith("sqlite"):
        queries.append(lt.Table("DOCS"))
    for query, count in zip(queries, [10, 5, 10]):
        rows = list(lt.CachedQueryDataset(db, query, ["instruction"], return_keys=True))
        assert sorted(_keys(rows)) == list(range(count))
    with pytest.raises(lt.QueryError, match="nope"):
        len(lt.CachedQueryDataset(db, lt.Table("nope"), ["instruction"]))


def test_plain_iteration_state_is_exact_mid_window(any_uri: str) -> None:
    fill(any_uri, "docs", _rows(100))
    db = lt.connect(any_uri)

    def plain() -> lt.CachedQueryDataset:
        return lt.CachedQueryDataset(
            db, _select(any_uri), "instruction", cache_size=32, seed=2, rank=0, world_size=1
        )

    full = [r["instruction"] for r in plain()]
    ds = plain()
    it = iter(ds)
    head = [next(it)["instruction"] for _ in range(45)]  # stops inside the second window
    assert ds.state_dict()["consumed"] == 45
    it.close()
    assert ds.state_dict()["consumed"] == 45
    fresh = plain()
    fresh.load_state_dict(ds.state_dict())
    assert head + [r["instruction"] for r in fresh] == full


def test_a_missing_column_fails_at_once_not_after_the_retry_budget(sqlite_uri: str) -> None:
    from unittest import mock

    from llmtrain.db.backend import DataBackend

    fill(sqlite_uri, "docs", _rows(10))
    db = lt.connect(sqlite_uri)
    query = lt.sql("SELECT id, nope FROM docs", key="id")
    with (
        mock.patch.object(DataBackend, "reconnect", autospec=True) as reconnect,
        pytest.raises(lt.QueryError, match="no such column: nope"),
    ):
        len(lt.CachedQueryDataset(db, query, "nope"))
    assert reconnect.call_count == 0  # no retry


def test_loader_can_hand_over_key_row_pairs(sqlite_uri: str) -> None:
    fill(sqlite_uri, "docs", _rows(10))
    db = lt.connect(sqlite_uri)
    ds = lt.CachedQueryDataset(db, lt.Table("docs"), "output", shuffle=False, rank=0, world_size=1)
    batches = list(ds.loader(4, with_keys=True))
    assert batches[0] == [
        (0, {"output": "out 0"}),
        (1, {"output": "out 1"}),
        (2, {"output": "out 2"}),
        (3, {"output": "out 3"}),
    ]
    assert [len(b) for b in batches] == [4, 4, 2]


def test_held_out_split_is_a_view_of_the_keyed_order(any_uri: str) -> None:
    from llmtrain.data import held_out, take_snapshot
    from llmtrain.data.snapshot import MemoryStore

    fill(any_uri, "docs", _rows(300))
    db = lt.connect(any_uri)
    store = MemoryStore()
    scan = take_snapshot(db, _select(any_uri), eval_fraction=0.2, chunk_size=20, store=store)
    assert scan.count == 300 and scan.fingerprint != scan.train.fingerprint
    held = [k for k in range(300) if held_out(k, 0.2)]
    assert (scan.view("train").count, scan.view("held_out").count) == (300 - len(held), len(held))

    def view(split: str, rank: int, world: int, **kwargs: Any) -> lt.CachedQueryDataset:
        return _dataset(
            db,
            any_uri,
            split=split,
            eval_fraction=0.2,
            snapshot=scan,
            store=store,
            rank=rank,
            world_size=world,
            seed=4,
            **kwargs,
        )

    train = [_keys(list(view("train", r, 2))) for r in range(2)]
    assert len(train[0]) == len(train[1]) == len(view("train", 0, 2)) == (300 - len(held)) // 2
    assert not set(train[0]) & set(train[1]) and not set(held) & set(train[0] + train[1])
    evaluation = view("held_out", 0, 1, shuffle=False)
    assert _keys(list(evaluation)) == held
    # the held-out rows are read by key: no training row is fetched to find them
    assert evaluation.stats.rows_fetched == len(held)
    # and the first held-out rows need only the keys around them, not the whole selection
    first = view("held_out", 0, 1, shuffle=False, prefetch=False)
    it = iter(first)
    assert _keys([next(it) for _ in range(10)]) == held[:10]
    assert first.stats.rows_fetched == 16 and first.stats.keys_fetched == 0

    # resuming a training view continues at the next training row, with workers too
    ds = view("train", 1, 2)
    loader = ds.loader(8, num_workers=1)
    head: list[Any] = []
    for batch in loader:
        head += _keys(batch)
        if len(head) >= 40:
            break
    fresh = view("train", 1, 2)
    fresh.load_state_dict(loader.state_dict())
    assert head + [k for b in fresh.loader(8) for k in _keys(b)] == train[1]
    with pytest.raises(ConfigError, match="split='train'"):
        _dataset(db, any_uri, seed=4, rank=1, world_size=2).load_state_dict(ds.state_dict())


def test_a_given_snapshot_is_used_and_must_fit(sqlite_uri: str) -> None:
    from llmtrain.data import take_snapshot
    from llmtrain.data.snapshot import MemoryStore

    fill(sqlite_uri, "docs", _rows(50))
    db = lt.connect(sqlite_uri)
    store = MemoryStore()
    snap = take_snapshot(db, lt.Table("docs"), store=store)
    ds = _dataset(db, sqlite_uri, snapshot=snap, store=store, rank=0, world_size=1)
    assert len(ds) == 50 and ds.stats.statements == 0  # nothing scanned again
    with pytest.raises(ConfigError, match="snapshot= describes another query"):
        _dataset(db, sqlite_uri, snapshot=snap, split="train", eval_fraction=0.5)
    with pytest.raises(ConfigError, match="split must be one of"):
        _dataset(db, sqlite_uri, split="eval")


def _batches(
    db: Any,
    snapshot: Any,
    args: Any,
    collate: Any,
    *,
    split: Any = "all",
    batch_size: int = 4,
    accumulation: int = 1,
) -> Any:
    """TrainBatches over the ``split`` view of ``docs`` (seed 3, one process)."""
    from llmtrain.training.batches import TrainBatches, view_dataset

    dataset = view_dataset(
        db,
        lt.Table("docs"),
        ["instruction", "output"],
        args,
        split=split,
        snapshot=snapshot,
        rank=0,
        world_size=1,
        seed=3,
    )
    return TrainBatches(
        dataset, args, batch_size=batch_size, collate=collate, accumulation=accumulation
    )


def test_train_batches_are_full_and_counted_from_training_rows(sqlite_uri: str) -> None:
    from llmtrain.config.args import DataArguments
    from llmtrain.data import held_out, take_snapshot

    fill(sqlite_uri, "docs", _rows(203))
    db = lt.connect(sqlite_uri)
    args = DataArguments(eval_fraction=0.25, cache_size=16)
    scan = take_snapshot(db, lt.Table("docs"), eval_fraction=0.25, chunk_size=40)  # db.artifacts
    batches = _batches(db, scan, args, lambda rows: rows, split="train", batch_size=8)
    groups = list(batches._groups(0, len(batches)))
    got = [b for g in groups for b in g.batches]
    n_train = sum(not held_out(k, 0.25) for k in range(203))
    assert [g.step for g in groups] == list(range(1, len(batches) + 1))
    assert len(got) == len(batches) == -(-n_train // 8)
    assert [len(b) for b in got[:-1]] == [8] * (len(got) - 1) and 0 < len(got[-1]) <= 8
    assert not any(held_out(k, 0.25) for b in got for k, _ in b)
    # the next epoch starts where the rule says, in another order
    (second,) = batches._groups(len(batches), len(batches) + 1)
    assert second.epoch == 1 and second.step == len(batches) + 1


def test_train_batches_made_ahead_count_only_once_the_loop_takes_them(sqlite_uri: str) -> None:
    """The next groups are made in a thread while the loop trains: the loop gets them in
    step order, a read error reaches the loop's thread at the step it belongs to, and
    closing the stream stops the thread."""
    import threading
    import time

    from llmtrain.config.args import DataArguments
    from llmtrain.data import take_snapshot

    fill(sqlite_uri, "docs", _rows(40))
    db = lt.connect(sqlite_uri)
    args = DataArguments(cache_size=16)
    snapshot = take_snapshot(db, lt.Table("docs"))

    def make(collate: Any) -> Any:
        return _batches(db, snapshot, args, collate, accumulation=2)

    batches = make(lambda rows: rows)
    stream = batches.steps(0, 10)
    taken = [next(stream), next(stream)]
    deadline = time.monotonic() + 30
    while batches.dataset.position.consumed <= 16:
        assert time.monotonic() < deadline, "the thread never read ahead"
        time.sleep(0.01)
    assert [g.step for g in taken] == [1, 2]
    assert sum(len(b) for g in taken for b in g.batches) == 16
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "llmtrain-batches"]

    order = [k for g in make(lambda rows: rows)._groups(0, 5) for b in g.batches for k, _ in b]
    fails_at = order.index(30) // 8  # the step whose rows hold key 30

    def failing(rows: list[Any]) -> list[Any]:
        if any(key == 30 for key, _ in rows):
            raise ValueError("the collate failed on key 30")
        return rows

    trained = []
    with pytest.raises(ValueError, match="key 30"):
        for group in make(failing).steps(0, 5):
            trained.append(group)
    assert len(trained) == fails_at


def test_each_group_carries_the_skips_of_its_own_rows(sqlite_uri: str) -> None:
    """Rows deleted since the snapshot leave holes: a step keeps its number, and each group
    hands the loop exactly the keys its own positions found deleted (no shared counters the
    thread making groups ahead would have to update)."""
    import sqlite3

    from llmtrain.config.args import DataArguments
    from llmtrain.data import take_snapshot
    from llmtrain.db.keys import key_repr

    fill(sqlite_uri, "docs", _rows(40))
    db = lt.connect(sqlite_uri)
    args = DataArguments(cache_size=8)
    snapshot = take_snapshot(db, lt.Table("docs"))
    with sqlite3.connect(sqlite_uri.removeprefix("sqlite:///")) as conn:
        conn.execute("DELETE FROM docs WHERE id % 5 = 0")  # gone since the snapshot
    batches = _batches(db, snapshot, args, lambda rows: rows)
    rule = batches.rule
    indexes = rule.order.indexes(0, 0)
    groups = list(batches._groups(0, rule.per_epoch))
    assert [g.step for g in groups] == list(range(1, rule.per_epoch + 1))
    for group in groups:
        mine = indexes[(group.step - 1) * rule.rows : group.step * rule.rows].tolist()
        keys = snapshot.train.keys(db.artifacts, 0, 40)
        gone = sorted(keys[i] for i in mine if keys[i] % 5 == 0)
        assert sorted(group.deleted) == sorted(group.skipped) == gone
        trained = sorted(key_repr(k) for b in group.batches for k, _ in b)
        assert trained == sorted(key_repr(keys[i]) for i in mine if keys[i] % 5)
