"""Property tests over row counts, world sizes, worker counts and window sizes."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
from conftest import fill
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmtrain as lt
from llmtrain.data.plan import rows_per_rank


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Any:
    uri = f"sqlite:///{Path(tmp_path_factory.mktemp('prop')) / 'rows.db'}"
    fill(uri, "docs", [{"id": i, "text": f"t{i}"} for i in range(2000)])
    return lt.connect(uri)


def _epoch_keys(
    db: Any,
    n: int,
    rank: int,
    world: int,
    workers: int,
    *,
    cache: int,
    drop: bool,
    seed: int = 11,
    epoch: int = 0,
    batch: int = 3,
) -> list[Any]:
    ds = lt.CachedQueryDataset(
        db,
        lt.Table("docs").where("id < :n", n=n),
        "text",
        cache_size=cache,
        seed=seed,
        rank=rank,
        world_size=world,
        drop_remainder=drop,
        return_keys=True,
    )
    ds.set_epoch(epoch)
    keys = [r["_key"] for b in ds.loader(batch, num_workers=workers) for r in b]
    if workers == 0:
        assert ds.stats.rows_fetched == len(keys)  # read its share, nothing more
    return keys


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(0, 2000),
    world=st.integers(1, 8),
    workers=st.integers(0, 3),
    cache=st.sampled_from([1, 7, 64, 500]),
    drop=st.booleans(),
)
def test_every_row_once_equal_counts_deterministic(
    db: Any, n: int, world: int, workers: int, cache: int, drop: bool
) -> None:
    per_rank = [_epoch_keys(db, n, r, world, workers, cache=cache, drop=drop) for r in range(world)]
    expected = rows_per_rank(n, world, drop)
    assert all(len(keys) == expected for keys in per_rank)
    counts = collections.Counter(k for keys in per_rank for k in keys)
    if drop:
        assert max(counts.values(), default=1) == 1
        assert len(counts) == n - n % world
    else:
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == (-n) % world
    # the same seed gives the same order, with any worker count; a new epoch a new one
    again = _epoch_keys(db, n, 0, world, (workers + 1) % 4, cache=cache, drop=drop)
    assert again == per_rank[0]
    if expected >= 20 and cache < expected:
        assert _epoch_keys(db, n, 0, world, 0, cache=cache, drop=drop, epoch=1) != per_rank[0]


@settings(max_examples=150, deadline=None)
@given(
    count=st.integers(1, 200),
    block=st.integers(1, 40),
    seed=st.integers(0, 3),
    shuffle=st.booleans(),
    drop=st.booleans(),
    world=st.integers(1, 4),
    epoch=st.integers(0, 2),
)
def test_locate_finds_every_row_where_the_epoch_order_reads_it(
    count: int, block: int, seed: int, shuffle: bool, drop: bool, world: int, epoch: int
) -> None:
    """Lineage locates a row without walking the blocks: each (rank, position) it names is where
    that rank's order of the epoch reads the row, and none is missed (dropped, or wrapped twice)."""
    import numpy as np

    from llmtrain.data.plan import Order

    order = Order(count, block, seed, shuffle, drop, world)
    read = [order.indexes(epoch, rank) for rank in range(world)]
    for index in range(count):
        where = [(r, int(p)) for r in range(world) for p in np.flatnonzero(read[r] == index)]
        assert sorted(order.locate(index, epoch)) == where, index
