"""What the data side costs a training run: rows/s, peak memory, and the share of a step
spent waiting for data.

    python benchmarks/bench_datasets.py [--rows 1000000] [--backends sqlite,postgresql]
        [--quick] [--rounds 3] [--cache-size 1024] [--steps 60] [--no-memory]
        [--no-steps] [--num-workers 0] [--cleanup]

Data: ``docs(id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)`` with ``--rows`` rows
of short varied text, plus ``docs_small`` (its first tenth) for the memory comparison. SQLite
uses ``$TMPDIR/llmtrain_bench/docs_<rows>.db``; PostgreSQL (``LLMTRAIN_BENCH_PG``, default
``postgresql+psycopg://postgres@127.0.0.1:5432``) the database ``lt_bench`` (1M rows) or
``lt_bench_<rows>``. Tables already holding the right count are reused; ``--cleanup`` drops
them at the end.

Throughput: rows/s of full shuffled epochs of ``CachedQueryDataset`` (best and median of the
rounds, and by CPU time); the one-off key snapshot is timed apart.

Memory: an epoch over ``rows // 10`` and over ``rows`` rows, each in a fresh subprocess so
the peaks cannot mix: ``ru_maxrss``, the epoch's own RSS peak and the tracemalloc peak.

Data wait: the figure that matters. A real ``fit()`` of the demo's model and settings
(``examples/demo.py``: tiny LoRA model, batch 16), first on the demo's own table, then on the
``rows``-row table; the time the loop spends getting its next batch (read, tokenize,
collate, move) as a share of each step. Runs on CPU, where a step of the tiny model is far
shorter than a real model's step on a GPU, so the share here is an upper bound. Beside it,
the cost: each fit is run again with its batches made beforehand and replayed from memory
(ABAB, ``--rounds`` pairs), and the median step of the real fit over the replayed one tells
what the data side costs a step in all, including the making thread's share of the CPU and
the GIL, which the wait alone does not show.

Goals: data wait under 2% of a step, and peak RSS at ``rows`` within 10% of that at
``rows // 10``. Exit status 0 when both are met.
"""

from __future__ import annotations

import argparse
import itertools
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
sys.path.insert(0, str(ROOT / "examples"))  # `import demo`: the quick start's table

TABLE, SMALL_TABLE = "docs", "docs_small"
FIELDS = ("instruction", "output")
PG_ADMIN = os.environ.get("LLMTRAIN_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
PG_DATABASE = "lt_bench"  # the default size's; other sizes get lt_bench_<rows>
CHUNK = 50_000
GOAL_WAIT, GOAL_MEMORY = 0.02, 1.10

_WORDS = (
    "model",
    "data",
    "table",
    "row",
    "column",
    "query",
    "index",
    "token",
    "train",
    "epoch",
    "batch",
    "learning",
    "rate",
    "loss",
    "gradient",
    "layer",
    "weight",
    "adapter",
    "rank",
    "shard",
    "worker",
    "window",
    "cache",
    "key",
    "order",
    "seed",
    "shuffle",
    "prompt",
    "answer",
    "question",
    "explain",
    "summarise",
    "translate",
    "list",
    "compare",
    "describe",
    "write",
    "short",
    "long",
    "simple",
    "clear",
    "python",
    "sql",
    "database",
    "stream",
    "memory",
    "disk",
    "network",
    "fast",
    "slow",
    "small",
    "large",
    "first",
    "last",
    "next",
    "every",
    "each",
    "other",
    "same",
    "new",
    "old",
    "good",
    "best",
    "time",
    "value",
    "number",
    "text",
    "word",
)
_VERBS = ("Explain", "Summarise", "Describe", "List", "Compare", "Translate", "Rewrite")


# -- data ------------------------------------------------------------------------------------
def make_rows(lo: int, hi: int) -> list[tuple[int, str, str]]:
    """Rows ``lo..hi-1`` of short, varied text; deterministic per id so tables can be reused."""
    out = []
    for i in range(lo, hi):
        rng = random.Random(i)
        instruction = (
            f"{_VERBS[i % len(_VERBS)]} "
            + " ".join(rng.choices(_WORDS, k=3 + i % 8))
            + f" (item {i})"
        )
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
            con.execute(
                f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)"
            )
            if table == SMALL_TABLE:  # same rows as the head of docs
                con.execute(f"INSERT INTO {table} SELECT * FROM {TABLE} WHERE id < ?", (n,))
            else:
                for lo in range(0, n, CHUNK):
                    con.executemany(
                        f"INSERT INTO {table} VALUES (?, ?, ?)", make_rows(lo, min(n, lo + CHUNK))
                    )
            con.commit()
            print(
                f"  sqlite: filled {table} with {n:,} rows in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
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
        exists = admin.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (database,)
        ).fetchone()
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
            con.execute(
                f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)"
            )
            if table == SMALL_TABLE:
                con.execute(f"INSERT INTO {table} SELECT * FROM {TABLE} WHERE id < %s", (n,))
            else:
                with con.cursor().copy(
                    f"COPY {table} (id, instruction, output) FROM STDIN"
                ) as copy:
                    for lo in range(0, n, CHUNK):
                        for r in make_rows(lo, min(n, lo + CHUNK)):
                            copy.write_row(r)
            con.commit()
            print(
                f"  postgresql: filled {table} with {n:,} rows in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    with psycopg.connect(pg_dsn(database), autocommit=True) as con:
        con.execute(f"VACUUM ANALYZE {TABLE}")
        con.execute(f"VACUUM ANALYZE {SMALL_TABLE}")


def drop_postgres(database: str) -> None:
    import psycopg

    from llmtrain.db.engines import dispose_sql_engine

    dispose_sql_engine(f"{PG_ADMIN}/{database}")
    with psycopg.connect(pg_dsn("postgres"), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        )
        admin.execute(f"DROP DATABASE IF EXISTS {database}")


@dataclass
class Target:
    """One backend: its URI for llmtrain and how to drop its data."""

    name: str
    uri: str
    cleanup: Callable[[], None]


def prepare(backend: str, rows: int) -> Target:
    if backend == "sqlite":
        path = sqlite_path(rows)
        fill_sqlite(path, rows)

        def remove() -> None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)

        return Target("sqlite", f"sqlite:///{path}", remove)
    if backend in ("postgresql", "postgres"):
        database = pg_database(rows)
        fill_postgres(database, rows)
        return Target("postgresql", f"{PG_ADMIN}/{database}", lambda: drop_postgres(database))
    raise SystemExit(f"unknown backend {backend!r} (sqlite, postgresql)")


# -- throughput ------------------------------------------------------------------------------
def dataset(uri: str, table: str, cache_size: int) -> Any:
    import llmtrain

    return llmtrain.CachedQueryDataset(
        llmtrain.connect(uri),
        llmtrain.Table(table),
        list(FIELDS),
        cache_size=cache_size,
        shuffle=True,
        rank=0,
        world_size=1,
    )


def timed(rows: Iterator[dict], expected: int) -> tuple[float, float]:
    """Rows per second of draining ``rows``, by the wall clock and by this process's CPU
    time (all threads, the prefetch thread's included); checks nothing was lost."""
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
    """Rows/s per round (wall clock and CPU time), and the key scan's seconds."""

    backend: str
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    scan_s: float = 0.0


def bench_speed(target: Target, rows: int, cache_size: int, rounds: int) -> Speed:
    speed = Speed(target.name)
    ds = dataset(target.uri, TABLE, cache_size)
    t0 = time.perf_counter()
    scan = ds.snapshot()  # once per dataset, kept across epochs: timed apart
    speed.scan_s = time.perf_counter() - t0
    if scan.count != rows:
        raise SystemExit(f"{target.name}: {TABLE} has {scan.count} rows, expected {rows}")
    try:
        for r in range(rounds):
            ds.set_epoch(r)  # a new shuffled order each round
            wall, cpu = timed(iter(ds), rows)
            speed.wall.append(wall)
            speed.cpu.append(cpu)
            print(
                f"  {target.name} round {r + 1}/{rounds}: {wall:>10,.0f} rows/s "
                f"(by CPU time: {cpu:,.0f})",
                flush=True,
            )
    finally:
        ds.db.close()
    return speed


# -- data wait in a real fit -------------------------------------------------------------------
@dataclass
class Wait:
    """Seconds per optimizer step spent getting the batches, and training on them; and, side
    by side, whole steps of the same fit with its batches replayed from memory."""

    label: str
    rows: int
    data: list[float] = field(default_factory=list)
    train: list[float] = field(default_factory=list)
    replayed: list[float] = field(default_factory=list)

    @property
    def share(self) -> float:
        """Data wait over step time (each fit's first step, the loop's warm-up, left out)."""
        data, train = sum(self.data), sum(self.train)
        return data / max(data + train, 1e-9)

    @property
    def median_share(self) -> float:
        return statistics.median(d / (d + t) for d, t in zip(self.data, self.train))

    @property
    def cost(self) -> float:
        """Median whole step over the replayed one, less 1: what the data side costs a step,
        waits and the making thread's share of the CPU and the GIL together."""
        steps = [d + t for d, t in zip(self.data, self.train)]
        return statistics.median(steps) / statistics.median(self.replayed) - 1


def replaying(steps: int) -> Callable[..., Iterator[Any]]:
    """A ``TrainBatches.steps`` that makes ``steps`` groups before the first step and hands
    them out from memory: the same loop, with no data work left during training."""

    def from_memory(self: Any, after: int, total: int) -> Iterator[Any]:
        yield from list(itertools.islice(self._groups(after, total), steps))

    return from_memory


def timed_calls(call: Callable[..., Any], times: list[float]) -> Callable[..., Any]:
    """``call`` noting each call's seconds in ``times`` (a FitRun._train_step, say)."""

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = call(*args)
        times.append(time.perf_counter() - t0)
        return out

    return timed


def timing(make_steps: Callable[..., Iterator[Any]], waits: list[float]) -> Callable[..., Any]:
    """``make_steps`` (a ``TrainBatches.steps``) noting how long the loop waits for each
    step's group in ``waits``."""

    def timed(self: Any, after: int, total: int) -> Iterator[Any]:
        groups = make_steps(self, after, total)
        try:
            while True:
                t0 = time.perf_counter()
                group = next(groups, None)
                if group is None:
                    return
                waits.append(time.perf_counter() - t0)
                yield group
        finally:
            groups.close()

    return timed


def bench_wait(
    wait: Wait,
    uri: str,
    select: Any,
    steps: int,
    workdir: Path,
    model: Path,
    num_workers: int = 0,
    *,
    replay: bool = False,
) -> None:
    """``fit()`` with the demo's settings, timing FitRun's two halves of every step (with
    ``replay``: whole steps, the batches made beforehand)."""
    import llmtrain as lt
    from llmtrain.training import run as run_module
    from llmtrain.training.batches import TrainBatches

    fit_run = run_module.FitRun
    train_step = fit_run._train_step
    make_steps = TrainBatches.steps
    data: list[float] = []
    train: list[float] = []

    fit_run._train_step = timed_calls(train_step, train)  # type: ignore[method-assign]
    source = replaying(steps) if replay else make_steps
    TrainBatches.steps = timing(source, data)  # type: ignore[method-assign]
    run = f"{wait.label}-{len(wait.replayed) + len(wait.data)}"
    db = lt.connect(
        uri,
        metadata_uri=f"sqlite:///{workdir / f'meta-{run}.db'}",
        artifacts=workdir / f"artifacts-{run}",
    )
    try:
        trainer = lt.LLMTrainer(
            f"bench-{wait.label}",
            model=str(model),
            prompt_template="### Question:\n{X}\n\n### Answer:\n{Y}",
            max_steps=steps,
            batch_size=16,
            learning_rate=2e-2,
            lora_r=16,
            lora_dropout=0.0,
            progress_bar=False,
            dataloader_num_workers=num_workers,
        )
        trainer.fit(X="instruction", Y="output", db=db, select=select)
    finally:
        fit_run._train_step = train_step  # type: ignore[method-assign]
        TrainBatches.steps = make_steps  # type: ignore[method-assign]
        db.close()
    if replay:
        wait.replayed += [d + t for d, t in zip(data[1:], train[1:])]
        return
    wait.data += data[1:]
    wait.train += train[1:]
    print(
        f"  data wait, {wait.label}: {wait.share:.2%} of a step ({len(wait.data)} steps, median "
        f"{wait.median_share:.2%}; {statistics.median(wait.train) * 1e3:.1f} ms training, "
        f"{statistics.median(wait.data) * 1e3:.2f} ms waiting per step)",
        flush=True,
    )


def bench_waits(
    targets: list[Target], rows: int, steps: int, num_workers: int = 0, rounds: int = 1
) -> list[Wait]:
    """The demo's table, then every target's ``rows``-row table, with the demo's model: each
    as ``rounds`` pairs of fits, one making its batches as it trains and one replaying them
    (ABAB, so the machine's drift falls on both alike)."""
    import demo

    import llmtrain as lt
    from llmtrain.console import quiet

    quiet()
    workdir = Path(tempfile.mkdtemp(prefix="llmtrain-bench-fit-"))
    demo_db = workdir / "demo.db"
    demo.write_table(demo_db)
    corpus = [f"{r['instruction']} {r['output']}" for r in demo.rows()]
    from llmtrain.testing import tiny_model

    model = tiny_model(workdir / "tiny-llama", corpus=corpus)
    tables = [("demo", f"sqlite:///{demo_db}", lt.Table("docs").where("lang = :l", l="en"), 48)]
    tables += [(t.name, t.uri, lt.Table(TABLE), rows) for t in targets]
    waits = []
    for label, uri, select, count in tables:
        wait = Wait(label, count)
        for _ in range(rounds):
            for replay in (False, True):
                bench_wait(wait, uri, select, steps, workdir, model, num_workers, replay=replay)
        waits.append(wait)
    return waits


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
    return {
        "rows": n,
        "rows_traced": m,
        "seconds": elapsed,
        "maxrss_base_mib": base_maxrss,
        "maxrss_mib": peak_maxrss,
        "rss_start_mib": base_rss,
        "epoch_hwm_mib": peak_hwm,
        "traced_peak_mib": traced / 2**20,
    }


def bench_memory(target: Target, table: str, cache_size: int) -> dict[str, Any]:
    """Run ``memory_child`` in a fresh interpreter.

    Started through ``sh`` on purpose: a child exec'd straight from this (large) process
    inherits its peak RSS in ``ru_maxrss`` (Linux copies the old mm's high-water mark at
    exec), while ``sh`` forks it afresh from a small process.
    """
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        target.uri,
        table,
        "--cache-size",
        str(cache_size),
    ]
    done = subprocess.run(
        ["sh", "-c", '"$@"; exit $?', "sh", *cmd], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"memory subprocess failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- report ------------------------------------------------------------------------------------
def report(
    rows: int,
    cache_size: int,
    speeds: list[Speed],
    memory: dict[str, tuple[dict[str, Any], dict[str, Any]]],
    waits: list[Wait],
) -> bool:
    ok = True
    print(
        f"\n== throughput: full shuffled epoch of {rows:,} rows, cache_size={cache_size} "
        "(best of rounds; median in brackets) =="
    )
    print(f"{'backend':<12}{'rows/s':>24}{'by CPU time':>24}{'key scan':>12}")
    for s in speeds:
        print(
            f"{s.backend:<12}{max(s.wall):>12,.0f} ({statistics.median(s.wall):>9,.0f})"
            f"{max(s.cpu):>12,.0f} ({statistics.median(s.cpu):>9,.0f}){s.scan_s:>11.2f}s"
        )
    if waits:
        print(
            "\n== data wait: share of a training step spent getting its batch (fit() of the "
            "demo model, batch 16, CPU; first step left out) =="
        )
        print(
            "  cost = median step over the median step of the same fit with its batches\n"
            "  replayed from memory, less 1: waits, and the thread making batches competing\n"
            "  for the CPU and the GIL (ABAB pairs; this machine's noise is several percent)"
        )
        print(f"{'table':<12}{'rows':>11}{'steps':>7}{'share':>9}{'median':>9}{'cost':>8}  goal")
        for w in waits:
            good = w.share < GOAL_WAIT
            ok &= good
            print(
                f"{w.label:<12}{w.rows:>11,}{len(w.data):>7}{w.share:>9.2%}"
                f"{w.median_share:>9.2%}{w.cost:>+8.1%}  {'OK' if good else 'MISS'} "
                f"(share < {GOAL_WAIT:.0%})"
            )
    if memory:
        small = max(1, rows // 10)
        print(
            f"\n== memory: one epoch over {small:,} and over {rows:,} rows, a fresh process "
            "each (MiB) =="
        )
        print(
            "  ru_maxrss = whole-process peak (imports included); epoch peak = VmHWM reset "
            "at the epoch's start;\n  python peak = tracemalloc peak during a second epoch"
        )
        print(
            f"{'backend':<12}{'rows':>11}{'ru_maxrss':>11}{'RSS start':>11}{'epoch peak':>12}"
            f"{'python peak':>13}{'rows/s':>11}"
        )
        for name, pair in memory.items():
            for m in pair:
                hwm = m["epoch_hwm_mib"]
                print(
                    f"{name:<12}{m['rows']:>11,}{m['maxrss_mib']:>11.1f}"
                    f"{m['rss_start_mib'] or 0:>11.1f}"
                    f"{hwm if hwm is not None else float('nan'):>12.1f}"
                    f"{m['traced_peak_mib']:>13.1f}{m['rows'] / m['seconds']:>11,.0f}"
                )
            lo, hi = pair
            rss = hi["maxrss_mib"] / lo["maxrss_mib"]
            good = rss <= GOAL_MEMORY
            ok &= good
            line = (
                f"{name:<12}{'1M/100k' if rows == 1_000_000 else 'big/small':>11}  "
                f"ru_maxrss ratio {rss:.3f} ({hi['maxrss_mib'] - lo['maxrss_mib']:+.1f})"
            )
            if lo["epoch_hwm_mib"] is not None and hi["epoch_hwm_mib"] is not None:
                line += (
                    f", epoch peak ratio {hi['epoch_hwm_mib'] / lo['epoch_hwm_mib']:.3f} "
                    f"({hi['epoch_hwm_mib'] - lo['epoch_hwm_mib']:+.1f})"
                )
            line += (
                f", python peak ratio "
                f"{hi['traced_peak_mib'] / max(lo['traced_peak_mib'], 1e-9):.2f}  "
                f"{'OK' if good else 'MISS'} (ru_maxrss ratio <= {GOAL_MEMORY:.2f})"
            )
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
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="optimizer steps of each data-wait fit (default 60, the demo's)",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="data_args.num_workers of the data-wait fits (0: formatting in the loop's process)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--no-steps", action="store_true", help="skip the data-wait fits")
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="drop the benchmark database/file afterwards (default: keep them "
        "so a re-run skips the fill)",
    )
    parser.add_argument("--memory-child", nargs=2, metavar=("URI", "TABLE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_child:
        print(json.dumps(memory_child(*args.memory_child, args.cache_size)))
        return 0

    rows = args.rows or (100_000 if args.quick else 1_000_000)
    rounds = args.rounds or (2 if args.quick else 3)
    speeds: list[Speed] = []
    memory: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    targets = []
    try:
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            print(f"[{backend}] preparing {rows:,} rows", flush=True)
            target = prepare(backend, rows)
            targets.append(target)
            speeds.append(bench_speed(target, rows, args.cache_size, rounds))
            if not args.no_memory:
                pair = tuple(bench_memory(target, t, args.cache_size) for t in (SMALL_TABLE, TABLE))
                memory[target.name] = pair
                print(
                    f"  {target.name} memory: ru_maxrss {pair[0]['maxrss_mib']:.1f} -> "
                    f"{pair[1]['maxrss_mib']:.1f} MiB",
                    flush=True,
                )
        waits = (
            []
            if args.no_steps
            else bench_waits(targets, rows, args.steps, args.num_workers, rounds)
        )
        ok = report(rows, args.cache_size, speeds, memory, waits)
    finally:
        if args.cleanup:
            for target in targets:
                target.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
