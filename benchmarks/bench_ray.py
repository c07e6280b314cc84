"""The Ray driver streaming a selection to its workers: driver memory and rows/s.

    python benchmarks/bench_ray.py [--rows 100000,1000000] [--workers 2] [--cache-size 1024]

For each size, in a fresh process (so the peaks cannot mix): a SQLite table
``docs(id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)`` (made once with executemany,
kept in ``$TMPDIR/llmtrain_bench/ray_docs_<rows>.db``), the run's key snapshot taken by the
driver, then ``--workers`` Ray workers (a local Ray instance) each reading one full epoch of
their rank's rows through the driver (:mod:`llmtrain.running.ray.bridge`, exactly what a Ray fit's
workers do, without the training). Reported: the driver's RSS before streaming and its peak
while streaming (sampled every 10 ms), rows/s delivered to all workers together, and as the
baseline, rows/s of the same epoch read by one local ``CachedQueryDataset`` in the driver.

Goal: the driver's peak while streaming at the largest size within 10% (+32 MiB) of the
smallest's: memory flat in table size. Exit status 0 when met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

FIELDS = ["instruction", "output"]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def make_table(rows: int) -> Path:
    folder = Path(tempfile.gettempdir()) / "llmtrain_bench"
    folder.mkdir(exist_ok=True)
    path = folder / f"ray_docs_{rows}.db"
    if path.exists():
        return path
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    con.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)")
    for start in range(0, rows, 50_000):
        con.executemany(
            "INSERT INTO docs VALUES (?, ?, ?)",
            (
                (i, " ".join(rng.choices(WORDS, k=12)), " ".join(rng.choices(WORDS, k=6)))
                for i in range(start, min(rows, start + 50_000))
            ),
        )
    con.commit()
    con.close()
    tmp.replace(path)
    return path


class Peak:
    """The process's RSS peak while the block runs, sampled every 10 ms."""

    def __init__(self) -> None:
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def read_share(broker: Any, snapshot: dict[str, Any], rank: int, world: int, cache: int) -> int:
    """A worker: one epoch of its rank's rows, through the driver."""
    import llmtrain as lt
    from llmtrain.data import RunSnapshot
    from llmtrain.running.ray.bridge import RemoteDB

    db = RemoteDB(broker)
    ds = lt.CachedQueryDataset(
        db,
        lt.Table("docs"),
        FIELDS,
        cache_size=cache,
        rank=rank,
        world_size=world,
        snapshot=RunSnapshot.from_record(snapshot),
        store=db.artifacts,
    )
    return sum(1 for _ in ds)


def measure(rows: int, workers: int, cache: int) -> dict[str, Any]:
    import psutil
    import ray

    import llmtrain as lt
    from llmtrain.data import take_snapshot
    from llmtrain.running.ray.bridge import serving

    path = make_table(rows)
    art = Path(tempfile.mkdtemp(prefix="llmtrain-bench-ray-"))
    db = lt.connect(f"sqlite:///{path}", artifacts=art)
    snapshot = take_snapshot(db, lt.Table("docs"))
    # the baseline: the same epoch read by one local dataset
    started = time.perf_counter()
    local = lt.CachedQueryDataset(db, lt.Table("docs"), FIELDS, cache_size=cache, snapshot=snapshot)
    local_rows = sum(1 for _ in local)
    local_s = time.perf_counter() - started
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    task = ray.remote(num_cpus=1)(read_share)
    ray.get([ray.remote(lambda: 0).remote() for _ in range(workers)])  # workers warm
    with serving(db, {}, threads=workers) as broker:
        before = psutil.Process().memory_info().rss
        with Peak() as peak:
            started = time.perf_counter()
            counts = ray.get(
                [
                    task.remote(broker, snapshot.to_record(), r, workers, cache)
                    for r in range(workers)
                ]
            )
            seconds = time.perf_counter() - started
    ray.shutdown()
    return {
        "rows": rows,
        "delivered": sum(counts),
        "driver_rss_before_mib": round(before / 2**20, 1),
        "driver_rss_peak_mib": round(peak.peak / 2**20, 1),
        "driver_growth_mib": round((peak.peak - before) / 2**20, 1),
        "rows_per_s_ray": round(sum(counts) / seconds),
        "rows_per_s_local": round(local_rows / local_s),
        "ray_vs_local": round(sum(counts) / seconds / (local_rows / local_s), 3),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-size", type=int, default=1024)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.workers, args.cache_size)))
        return 0
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        make_table(rows)
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                str(rows),
                "--workers",
                str(args.workers),
                "--cache-size",
                str(args.cache_size),
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    small, large = results[0], results[-1]
    flat = large["driver_rss_peak_mib"] <= small["driver_rss_peak_mib"] * 1.10 + 32
    print(
        f"driver peak {small['driver_rss_peak_mib']} MiB at {small['rows']} rows, "
        f"{large['driver_rss_peak_mib']} MiB at {large['rows']} rows: "
        f"{'flat' if flat else 'NOT flat'}; {large['rows_per_s_ray']} rows/s to "
        f"{args.workers} workers ({large['ray_vs_local']}x one local reader)"
    )
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
