"""Throughput and memory of CachedQueryDataset against a hand-written raw-driver loop.

    python benchmarks/bench_datasets.py [--rows 1000000] [--backends sqlite,postgresql]
        [--quick] [--rounds 3] [--cache-size 1024] [--no-memory] [--cleanup]

Data: ``docs(id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)`` with ``--rows`` rows
of short varied text, plus ``docs_small`` (its first tenth) for the memory comparison. SQLite
uses ``$TMPDIR/llmtrain_bench/docs_<rows>.db``; PostgreSQL (``LLMTRAIN_BENCH_PG``, default
``postgresql+psycopg://postgres@127.0.0.1:5432``) the database ``lt_bench`` (1M rows) or
``lt_bench_<rows>``. Tables already holding the right count are reused; ``--cleanup`` drops
them at the end.

Throughput: in one process, rounds alternate (ABAB...) a full shuffled epoch of
``CachedQueryDataset`` with a raw sqlite3/psycopg keyset loop reading the same pages in the
same order and building the same dict per row: the best one can do by hand. The machine is
noisy, so the ratio is best-of-rounds over best-of-rounds, next to the median of the rounds'
own ratios, and the same by CPU time. The one-off key scan is timed apart.

Memory: an epoch over ``rows // 10`` and over ``rows`` rows, each in a fresh subprocess so
the peaks cannot mix: ``ru_maxrss``, the epoch's own RSS peak and the tracemalloc peak.

Goals: ours/raw >= 0.8, and peak RSS at ``rows`` within 10% of that at ``rows // 10``.
Exit status 0 when both are met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

TABLE, SMALL_TABLE = "docs", "docs_small"
FIELDS = ("instruction", "output")
PG_ADMIN = os.environ.get("LLMTRAIN_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
PG_DATABASE = "lt_bench"  # the default size's; other sizes get lt_bench_<rows>
CHUNK = 50_000
GOAL_RATIO, GOAL_MEMORY = 0.8, 1.10

_WORDS = (
    "model", "data", "table", "row", "column", "query", "index", "token", "train", "epoch",
    "batch", "learning", "rate", "loss", "gradient", "layer", "weight", "adapter", "rank",
    "shard", "worker", "window", "cache", "key", "order", "seed", "shuffle", "prompt", "answer",
    "question", "explain", "summarise", "translate", "list", "compare", "describe", "write",
    "short", "long", "simple", "clear", "python", "sql", "database", "stream", "memory", "disk",
    "network", "fast", "slow", "small", "large", "first", "last", "next", "every", "each",
    "other", "same", "new", "old", "good", "best", "time", "value", "number", "text", "word",
)
_VERBS = ("Explain", "Summarise", "Describe", "List", "Compare", "Translate", "Rewrite")


# -- data ------------------------------------------------------------------------------------
def make_rows(lo: int, hi: int) -> list[tuple[int, str, str]]:
    """Rows ``lo..hi-1`` of short, varied text; deterministic per id so tables can be reused."""
    out = []
    for i in range(lo, hi):
        rng = random.Random(i)
        instruction = (f"{_VERBS[i % len(_VERBS)]} " +
                       " ".join(rng.choices(_WORDS, k=3 + i % 8)) + f" (item {i})")
        output = " ".join(rng.choices(_WORDS, k=8 + (i * 7) % 25)) + "."
        out.append((i, instruction, output))
    return out


def sqlite_path(rows: int) -> Path:
    """One file per size in a stable temp folder, so a re-run finds its data."""
    folder = Path(tempfile.gettempdir()) / "llmtrain_bench"
    folder.mkdir(exist_ok=True)
    return folder / f"docs_{rows}.db"


def sqlite_count(path: Path, table: str) -> int | None:
    if not path.exists():
        return None
    con = sqlite3.connect(path)
    try:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    except sqlite3.OperationalError:
        return None
    finally:
        con.close()


def fill_sqlite(path: Path, rows: int) -> None:
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=OFF")
        for table, n in ((TABLE, rows), (SMALL_TABLE, max(1, rows // 10))):
            if sqlite_count(path, table) == n:
                continue
            t0 = time.perf_counter()
            con.execute(f"DROP TABLE IF EXISTS {table}")
            con.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, instruction TEXT, "
                        "output TEXT)")
            if table == SMALL_TABLE:  # same rows as the head of docs
                con.execute(f"INSERT INTO {table} SELECT * FROM {TABLE} WHERE id < ?", (n,))
            else:
                for lo in range(0, n, CHUNK):
                    con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?)",
                                    make_rows(lo, min(n, lo + CHUNK)))
            con.commit()
            print(f"  sqlite: filled {table} with {n:,} rows in "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        con.close()


def pg_dsn(database: str) -> str:
    """The libpq form of the SQLAlchemy URL (psycopg does not take the ``+driver`` part)."""
    from sqlalchemy.engine import make_url

    url = make_url(f"{PG_ADMIN}/{database}").set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def pg_database(rows: int) -> str:
    """One database per size, so switching between --quick and full runs refills nothing."""
    return PG_DATABASE if rows == 1_000_000 else f"{PG_DATABASE}_{rows}"


def fill_postgres(database: str, rows: int) -> None:
    import psycopg

    with psycopg.connect(pg_dsn("postgres"), autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                               (database,)).fetchone()
        if not exists:
            admin.execute(f"CREATE DATABASE {database}")
    with psycopg.connect(pg_dsn(database)) as con:
        for table, n in ((TABLE, rows), (SMALL_TABLE, max(1, rows // 10))):
            try:
                have = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            except psycopg.errors.UndefinedTable:
                con.rollback()
                have = None
            if have == n:
                continue
            t0 = time.perf_counter()
            con.execute(f"DROP TABLE IF EXISTS {table}")
            con.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, instruction TEXT, "
                        "output TEXT)")
            if table == SMALL_TABLE:
                con.execute(f"INSERT INTO {table} SELECT * FROM {TABLE} WHERE id < %s", (n,))
            else:
                with con.cursor().copy(f"COPY {table} (id, instruction, output) FROM STDIN"
                                       ) as copy:
                    for lo in range(0, n, CHUNK):
                        for r in make_rows(lo, min(n, lo + CHUNK)):
                            copy.write_row(r)
            con.commit()
            print(f"  postgresql: filled {table} with {n:,} rows in "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
    with psycopg.connect(pg_dsn(database), autocommit=True) as con:
        con.execute(f"VACUUM ANALYZE {TABLE}")
        con.execute(f"VACUUM ANALYZE {SMALL_TABLE}")


def drop_postgres(database: str) -> None:
    import psycopg

    from llmtrain.backends.engines import dispose_sql_engine

    dispose_sql_engine(f"{PG_ADMIN}/{database}")
    with psycopg.connect(pg_dsn("postgres"), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = %s AND pid <> pg_backend_pid()", (database,))
        admin.execute(f"DROP DATABASE IF EXISTS {database}")


@dataclass
class Target:
    """One backend: its URI for llmtrain and how to open a raw DBAPI connection."""

    name: str
    uri: str
    raw_connect: Callable[[], Any]
    placeholder: str
    cleanup: Callable[[], None]


def prepare(backend: str, rows: int) -> Target:
    if backend == "sqlite":
        path = sqlite_path(rows)
        fill_sqlite(path, rows)

        def remove() -> None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)

        return Target("sqlite", f"sqlite:///{path}", lambda: sqlite3.connect(path), "?",
                      remove)
    if backend in ("postgresql", "postgres"):
        import psycopg

        database = pg_database(rows)
        fill_postgres(database, rows)
        return Target("postgresql", f"{PG_ADMIN}/{database}",
                      lambda: psycopg.connect(pg_dsn(database), autocommit=True), "%s",
                      lambda: drop_postgres(database))
    raise SystemExit(f"unknown backend {backend!r} (sqlite, postgresql)")


# -- the two readers -------------------------------------------------------------------------
def dataset(uri: str, table: str, cache_size: int) -> Any:
    import llmtrain

    return llmtrain.CachedQueryDataset(llmtrain.connect(uri), llmtrain.Table(table),
                                       list(FIELDS), cache_size=cache_size, shuffle=True,
                                       rank=0, world_size=1)


def page_keys(ds: Any) -> list[Any]:
    """The lower key of every window the dataset reads this epoch, in its visit order."""
    from llmtrain.datasets.plan import rank_pieces

    scan = ds.scan()
    pieces = rank_pieces(scan.count, ds.cache_size, seed=ds.seed, epoch=ds.epoch,
                         shuffle=ds.shuffle, world_size=1, rank=0)
    return [scan.boundaries[p.block] for p in pieces]


def raw_rows(con: Any, placeholder: str, lowers: list[Any], limit: int) -> Iterator[dict]:
    """The hand-written loop: one keyset SELECT per window, one dict per row."""
    sql = (f"SELECT id, instruction, output FROM {TABLE} WHERE id >= {placeholder} "
           f"ORDER BY id LIMIT {placeholder}")
    cur = con.cursor()
    for lower in lowers:
        cur.execute(sql, (lower, limit))
        for r in cur.fetchall():
            yield {"instruction": r[1], "output": r[2]}
    cur.close()


def timed(rows: Iterator[dict], expected: int) -> tuple[float, float]:
    """Rows per second of draining ``rows``, by the wall clock and by this process's CPU
    time (all threads); checks nothing was lost."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for _ in rows:
        n += 1
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if n != expected:
        raise SystemExit(f"read {n} rows, expected {expected}")
    return n / elapsed, n / max(cpu, 1e-9)


@dataclass
class Speed:
    """Rows/s per round for both readers (wall clock), and the same by CPU time."""

    backend: str
    ours: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    ours_cpu: list[float] = field(default_factory=list)
    raw_cpu: list[float] = field(default_factory=list)
    scan_s: float = 0.0

    def add(self, ours: tuple[float, float], raw: tuple[float, float]) -> None:
        self.ours.append(ours[0])
        self.ours_cpu.append(ours[1])
        self.raw.append(raw[0])
        self.raw_cpu.append(raw[1])

    @property
    def ratio(self) -> float:
        return max(self.ours) / max(self.raw)

    @property
    def median_ratio(self) -> float:
        """Median of each round's ours/raw: adjacent runs share the machine's load."""
        return statistics.median(a / b for a, b in zip(self.ours, self.raw))

    @property
    def cpu_ratio(self) -> float:
        """Ours/raw by CPU time: less sensitive to other processes, blind to waiting on a
        server (so for a client/server database it reads higher than the wall clock)."""
        return max(self.ours_cpu) / max(self.raw_cpu)


def bench_speed(target: Target, rows: int, cache_size: int, rounds: int) -> Speed:
    speed = Speed(target.name)
    ds = dataset(target.uri, TABLE, cache_size)
    t0 = time.perf_counter()
    scan = ds.scan()  # once per dataset, cached across epochs: timed apart
    speed.scan_s = time.perf_counter() - t0
    if scan.count != rows:
        raise SystemExit(f"{target.name}: {TABLE} has {scan.count} rows, expected {rows}")
    con = target.raw_connect()
    try:
        for r in range(rounds):
            ds.set_epoch(r)  # a new shuffled order each round, same order for both sides
            lowers = page_keys(ds)
            speed.add(timed(iter(ds), rows),
                      timed(raw_rows(con, target.placeholder, lowers, cache_size), rows))
            print(f"  {target.name} round {r + 1}/{rounds}: ours {speed.ours[-1]:>10,.0f} "
                  f"rows/s   raw {speed.raw[-1]:>10,.0f} rows/s   "
                  f"(by CPU time: {speed.ours_cpu[-1]:,.0f} vs {speed.raw_cpu[-1]:,.0f})",
                  flush=True)
    finally:
        con.close()
        ds.db.close()
    return speed


# -- memory (each size in a fresh subprocess) ------------------------------------------------
def rss_mib() -> float:
    """Peak resident set so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def _status_mib(field_name: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Restart the kernel's peak-RSS counter (Linux), so VmHWM covers only what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_child(uri: str, table: str, cache_size: int) -> dict[str, Any]:
    """One epoch for the RSS peaks, then a fresh dataset's epoch under tracemalloc.

    ``ru_maxrss`` is the whole process's peak, imports (torch) included. ``VmHWM`` after a
    reset isolates the epoch's own peak above the resident set it started from.
    tracemalloc's bookkeeping inflates RSS, so it runs only after the RSS figures are read.
    """
    import llmtrain  # noqa: F401 - imports (torch, sqlalchemy) belong to the baseline

    ds = dataset(uri, table, cache_size)
    ds.db.backend  # noqa: B018 - open the engine before the baseline is read
    base_maxrss = rss_mib()
    hwm_ok = reset_peak()
    base_rss = _status_mib("VmRSS")
    t0 = time.perf_counter()
    n = sum(1 for _ in ds)
    elapsed = time.perf_counter() - t0
    peak_maxrss = rss_mib()
    peak_hwm = _status_mib("VmHWM") if hwm_ok else None
    ds.db.close()

    ds = dataset(uri, table, cache_size)
    tracemalloc.start()
    m = sum(1 for _ in ds)
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ds.db.close()
    return {"rows": n, "rows_traced": m, "seconds": elapsed, "maxrss_base_mib": base_maxrss,
            "maxrss_mib": peak_maxrss, "rss_start_mib": base_rss,
            "epoch_hwm_mib": peak_hwm, "traced_peak_mib": traced / 2**20}


def bench_memory(target: Target, table: str, cache_size: int) -> dict[str, Any]:
    """Run ``memory_child`` in a fresh interpreter.

    Started through ``sh`` on purpose: a child exec'd straight from this (large) process
    inherits its peak RSS in ``ru_maxrss`` (Linux copies the old mm's high-water mark at
    exec), while ``sh`` forks it afresh from a small process.
    """
    cmd = [sys.executable, __file__, "--memory-child", target.uri, table,
           "--cache-size", str(cache_size)]
    done = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *cmd], capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"memory subprocess failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- report ------------------------------------------------------------------------------------
def report(rows: int, cache_size: int, speeds: list[Speed],
           memory: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> bool:
    ok = True
    print(f"\n== throughput: full shuffled epoch of {rows:,} rows, cache_size={cache_size} "
          "(best of rounds; in brackets the median, and for the ratio the median of "
          "the rounds' ratios) ==")
    print(f"{'backend':<12}{'ours rows/s':>22}{'raw rows/s':>22}{'ours/raw':>16}  goal")
    for s in speeds:
        good = s.ratio >= GOAL_RATIO
        ok &= good
        print(f"{s.backend:<12}"
              f"{max(s.ours):>11,.0f} ({statistics.median(s.ours):>8,.0f})"
              f"{max(s.raw):>11,.0f} ({statistics.median(s.raw):>8,.0f})"
              f"{s.ratio:>9.2f} ({s.median_ratio:.2f})  "
              f"{'OK' if good else 'MISS'} (>= {GOAL_RATIO})")
    for s in speeds:
        print(f"  {s.backend}: by CPU time ours {max(s.ours_cpu):,.0f} vs raw "
              f"{max(s.raw_cpu):,.0f} rows/s, ratio {s.cpu_ratio:.2f}; one-off key scan "
              f"(count + boundaries) {s.scan_s:.2f}s, not in the figures")
    if memory:
        small = max(1, rows // 10)
        print(f"\n== memory: one epoch over {small:,} and over {rows:,} rows, a fresh process "
              "each (MiB) ==")
        print("  ru_maxrss = whole-process peak (imports included); epoch peak = VmHWM reset "
              "at the epoch's start;\n  python peak = tracemalloc peak during a second epoch")
        print(f"{'backend':<12}{'rows':>11}{'ru_maxrss':>11}{'RSS start':>11}{'epoch peak':>12}"
              f"{'python peak':>13}{'rows/s':>11}")
        for name, pair in memory.items():
            for m in pair:
                hwm = m["epoch_hwm_mib"]
                print(f"{name:<12}{m['rows']:>11,}{m['maxrss_mib']:>11.1f}"
                      f"{m['rss_start_mib'] or 0:>11.1f}"
                      f"{hwm if hwm is not None else float('nan'):>12.1f}"
                      f"{m['traced_peak_mib']:>13.1f}{m['rows'] / m['seconds']:>11,.0f}")
            lo, hi = pair
            rss = hi["maxrss_mib"] / lo["maxrss_mib"]
            good = rss <= GOAL_MEMORY
            ok &= good
            line = (f"{name:<12}{'1M/100k' if rows == 1_000_000 else 'big/small':>11}  "
                    f"ru_maxrss ratio {rss:.3f} ({hi['maxrss_mib'] - lo['maxrss_mib']:+.1f})")
            if lo["epoch_hwm_mib"] is not None and hi["epoch_hwm_mib"] is not None:
                line += (f", epoch peak ratio {hi['epoch_hwm_mib'] / lo['epoch_hwm_mib']:.3f} "
                         f"({hi['epoch_hwm_mib'] - lo['epoch_hwm_mib']:+.1f})")
            line += (f", python peak ratio "
                     f"{hi['traced_peak_mib'] / max(lo['traced_peak_mib'], 1e-9):.2f}  "
                     f"{'OK' if good else 'MISS'} (ru_maxrss ratio <= {GOAL_MEMORY:.2f})")
            print(line)
    print(f"\n{'all goals met' if ok else 'some goals missed'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="default 1,000,000 (quick: 100k)")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--quick", action="store_true", help="100k rows, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="ABAB rounds (default 3)")
    parser.add_argument("--cache-size", type=int, default=1024)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--cleanup", action="store_true",
                        help="drop the benchmark database/file afterwards (default: keep them "
                             "so a re-run skips the fill)")
    parser.add_argument("--memory-child", nargs=2, metavar=("URI", "TABLE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_child:
        print(json.dumps(memory_child(*args.memory_child, args.cache_size)))
        return 0

    rows = args.rows or (100_000 if args.quick else 1_000_000)
    rounds = args.rounds or (2 if args.quick else 3)
    speeds, memory = [], {}
    targets = []
    try:
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            print(f"[{backend}] preparing {rows:,} rows", flush=True)
            target = prepare(backend, rows)
            targets.append(target)
            speeds.append(bench_speed(target, rows, args.cache_size, rounds))
            if not args.no_memory:
                pair = tuple(bench_memory(target, t, args.cache_size)
                             for t in (SMALL_TABLE, TABLE))
                memory[target.name] = pair
                print(f"  {target.name} memory: ru_maxrss {pair[0]['maxrss_mib']:.1f} -> "
                      f"{pair[1]['maxrss_mib']:.1f} MiB", flush=True)
        ok = report(rows, args.cache_size, speeds, memory)
    finally:
        if args.cleanup:
            for target in targets:
                target.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
