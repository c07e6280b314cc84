"""What a run's key snapshot costs against reading the keys raw, and what it saves a resume.

    python benchmarks/bench_snapshot.py [--keys 1000000] [--rows 100000,1000000]
                                        [--backends sqlite,postgresql]

Part 1, ratios (``--keys`` rows per table; 0 skips it): for int, uuid and text keys, the time
to take a run's snapshot (``take_snapshot``, chunks in memory), without and with a held-out
split (``eval_fraction=0.1``), divided by the time the raw driver takes to read the same keys
in key order (SQLite: the sqlite3 module; PostgreSQL: psycopg's fetchall, and ``COPY (SELECT
k ...) TO STDOUT``, the faster of the two), measured side by side, best of 3.

Part 2, for each backend and row count (the tables of ``bench_datasets.py``, reused when present):

- snapshot: seconds to take it (keys only, keyset pages) and its size in the artifact store;
- start: time to the first row of a new run (take the snapshot, then read the first window);
- 1st step: time from ``fit()`` to the end of a real fit's first optimizer step (tiny model);
- resume: time to the first row of a resumed run (read the manifest from the run record,
  restore a mid-epoch state, read the first window: the chunks it needs and nothing else).

Side by side per backend: the smallest and the largest row count, and their ratio. The
resume's ratio stays near 1 (it reads no key of the table); the start's grows with the rows.

Part 3 (``--forget rows:forgotten``): what forgotten rows add to a snapshot, side by side with
the same table where none is forgotten (:func:`forget_cost`).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_datasets import FIELDS, TABLE, prepare  # noqa: E402

import llmtrain as lt  # noqa: E402
from llmtrain.data import RunSnapshot, take_snapshot  # noqa: E402
from llmtrain.data.snapshot import MemoryStore  # noqa: E402
from llmtrain.stores.artifacts.local import LocalArtifactStore  # noqa: E402

KEY_KINDS = {  # key kind -> (SQLite column, PostgreSQL column, key of row i)
    "int": ("INTEGER", "BIGINT", lambda i: i * 7 + 3),
    "uuid": ("TEXT", "UUID", lambda i: str(uuid.UUID(int=(i * 0x9E3779B97F4A7C15) % 2**128))),
    "text": ("TEXT", "TEXT", lambda i: f"doc-{i * 7919 % 10**9:09d}-{i}"),
}


def key_table(backend: str, kind: str, rows: int) -> tuple[str, list[Callable[[], int]]]:
    """A table ``keys_<kind>`` of ``rows`` rows (built once), and the raw reads of its keys
    (each returns the number of keys it read)."""
    lite, pg, make = KEY_KINDS[kind]
    name = f"keys_{kind}"
    if backend == "sqlite":
        path = Path(tempfile.gettempdir()) / f"llmtrain-bench-keys-{rows}.db"
        with sqlite3.connect(path) as conn:
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone():
                conn.execute(f"CREATE TABLE {name} (k {lite} PRIMARY KEY, v TEXT)")
                conn.executemany(
                    f"INSERT INTO {name} VALUES (?, 'x')", ((make(i),) for i in range(rows))
                )

        def raw() -> int:
            with sqlite3.connect(path) as conn:
                return len(conn.execute(f"SELECT k FROM {name} ORDER BY k").fetchall())

        return f"sqlite:///{path}", [raw]
    import psycopg

    database = f"llmtrain_bench_keys_{rows}"
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
            c.execute(f"CREATE DATABASE {database}")
    dsn = f"host=127.0.0.1 user=postgres dbname={database}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()
        if found is None or found[0] is None:
            conn.execute(f"CREATE TABLE {name} (k {pg} PRIMARY KEY, v TEXT)")
            with conn.cursor().copy(f"COPY {name} (k, v) FROM STDIN") as copy:
                for i in range(rows):
                    copy.write_row((make(i), "x"))
            conn.execute(f"ANALYZE {name}")

    def fetchall() -> int:
        with psycopg.connect(dsn) as conn:
            return len(conn.execute(f"SELECT k FROM {name} ORDER BY k").fetchall())

    def copy() -> int:
        statement = f"COPY (SELECT k FROM {name} ORDER BY k) TO STDOUT"
        with psycopg.connect(dsn) as conn, conn.cursor().copy(statement) as cp:
            return sum(bytes(data).count(b"\n") for data in cp)

    return f"postgresql+psycopg://postgres@127.0.0.1/{database}", [fetchall, copy]


def best(call: Callable[[], Any], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return min(times)


def ratios(backends: list[str], rows: int) -> None:
    print(
        f"{'backend':<12}{'keys':>6}{'raw':>9}{'snapshot':>10}{'ratio':>7}{'split':>9}{'ratio':>7}"
    )
    for backend in backends:
        for kind in KEY_KINDS:
            uri, raws = key_table(backend, kind, rows)
            db = lt.connect(uri)
            if any(raw() != rows for raw in raws):
                raise SystemExit(f"{uri}: keys_{kind} does not hold {rows} rows")
            raw_s = min(best(raw) for raw in raws)
            table = lt.Table(f"keys_{kind}")
            plain = best(partial(take_snapshot, db, table, store=MemoryStore()))
            split = best(partial(take_snapshot, db, table, eval_fraction=0.1, store=MemoryStore()))
            print(
                f"{backend:<12}{kind:>6}{raw_s:>8.2f}s{plain:>9.2f}s{plain / raw_s:>6.2f}x"
                f"{split:>8.2f}s{split / raw_s:>6.2f}x",
                flush=True,
            )
            db.close()


def dataset(db: Any, snapshot: RunSnapshot, store: Any) -> lt.CachedQueryDataset:
    return lt.CachedQueryDataset(
        db, lt.Table(TABLE), list(FIELDS), snapshot=snapshot, store=store, rank=0, world_size=1
    )


def measure(uri: str, rows: int) -> dict[str, float]:
    db = lt.connect(uri)
    with tempfile.TemporaryDirectory() as folder:
        store = LocalArtifactStore(folder)
        t0 = time.perf_counter()
        snapshot = take_snapshot(db, lt.Table(TABLE), store=store)
        snap_s = time.perf_counter() - t0
        size = sum(len(store.get_bytes(c)) for c in snapshot.train.chunks)
        ds = dataset(db, snapshot, store)
        next(iter(ds))
        start_s = time.perf_counter() - t0
        if snapshot.count != rows:
            raise SystemExit(f"{uri}: {snapshot.count} rows, expected {rows}")
        # a state half-way through the epoch, as a checkpoint holds it
        ds.position.restore(0, rows // 2)
        state, record = ds.state_dict(), snapshot.to_record()
        t0 = time.perf_counter()
        resumed = dataset(db, RunSnapshot.from_record(record), store)
        resumed.load_state_dict(state)
        next(iter(resumed))
        resume_s = time.perf_counter() - t0
    return {
        "snapshot_s": snap_s,
        "bytes": size,
        "start_s": start_s,
        "resume_s": resume_s,
        "step_s": first_step(uri),
    }


def first_step(uri: str) -> float:
    """Seconds from ``fit()`` to the end of its first optimizer step (the tiny model, one
    step of 16 rows; the metadata and artifacts in a scratch folder)."""
    from llmtrain.testing import tiny_model
    from llmtrain.training.callbacks import Callback

    class First(Callback):
        at = 0.0

        def on_step(self, run: Any, keys: list[str]) -> None:
            self.at = self.at or time.perf_counter()

    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model(Path(folder) / "tiny")
        db = lt.connect(uri, metadata_uri=f"sqlite:///{folder}/meta.db", artifacts=folder)
        seen = First()
        trainer = lt.LLMTrainer(
            "first-step",
            model=str(model),
            prompt_template="Q: {X}\nA: {Y}",
            max_steps=1,
            batch_size=16,
            progress_bar=False,
        )
        t0 = time.perf_counter()
        trainer.fit(X=FIELDS[0], Y=FIELDS[1], db=db, select=lt.Table(TABLE), callbacks=[seen])
        db.close()
        return seen.at - t0


def forget_cost(rows: int, forgotten: int) -> None:
    """Part 3: a SQLite table of ``rows`` int keys, twice side by side: one database with no
    forgotten row, one with ``forgotten`` keys forgotten (``db.forget``); the snapshot's time in
    each, best of 3, and the ratio (the cost of leaving the forgotten rows out); the forget's
    own time beside the raw key read's."""
    folder = Path(tempfile.mkdtemp(prefix="llmtrain-bench-forget-"))
    dbs = {}
    for name in ("plain", "forgotten"):
        with sqlite3.connect(folder / f"{name}.db") as conn:
            conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, q TEXT)")
            conn.execute(
                "WITH RECURSIVE s(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x < ?) "
                "INSERT INTO docs SELECT x * 3, 'q' FROM s",
                (rows - 1,),
            )
        dbs[name] = lt.connect(f"sqlite:///{folder / name}.db", artifacts=folder / name)
    step = max(rows // forgotten, 1) * 3
    t0 = time.perf_counter()
    dbs["forgotten"].forget("docs", list(range(0, step * forgotten, step))[:forgotten])
    forget_s = time.perf_counter() - t0
    raw = best(
        lambda: len(
            sqlite3.connect(folder / "plain.db")
            .execute("SELECT id FROM docs ORDER BY id")
            .fetchall()
        )
    )
    snap = {
        name: best(lambda db=db: take_snapshot(db, lt.Table("docs"), store=MemoryStore()))
        for name, db in dbs.items()
    }
    print(
        f"forget cost, SQLite, {rows:,} rows, {forgotten:,} forgotten: snapshot "
        f"{snap['plain']:.2f}s -> {snap['forgotten']:.2f}s "
        f"(x{snap['forgotten'] / snap['plain']:.3f}); the forget "
        f"{forget_s:.2f}s = {forget_s / raw:.1f}x the raw key read ({raw:.2f}s)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--forget", default="10000000:100000", help="rows:forgotten, '' skips")
    args = parser.parse_args(argv)
    if args.forget:
        forget_cost(*map(int, args.forget.split(":")))
    if args.keys:
        ratios(args.backends.split(","), args.keys)
    if not args.rows:
        return 0
    sizes = sorted(int(r) for r in args.rows.split(","))
    print(
        f"{'backend':<12}{'rows':>12}{'snapshot':>10}{'size':>12}{'start':>10}{'resume':>10}"
        f"{'1st step':>10}"
    )
    for backend in args.backends.split(","):
        results = {}
        for rows in sizes:
            target = prepare(backend, rows)
            r = results[rows] = measure(target.uri, rows)
            print(
                f"{target.name:<12}{rows:>12,}{r['snapshot_s']:>9.2f}s{r['bytes'] / 1e6:>10.2f}MB"
                f"{r['start_s']:>9.2f}s{r['resume_s'] * 1e3:>8.1f}ms{r['step_s']:>9.2f}s",
                flush=True,
            )
        small, large = results[sizes[0]], results[sizes[-1]]
        print(
            f"{backend}: {sizes[-1] // sizes[0]}x the rows -> start x"
            f"{large['start_s'] / small['start_s']:.1f}, resume x"
            f"{large['resume_s'] / small['resume_s']:.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
