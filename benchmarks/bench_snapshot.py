"""What a run's key snapshot costs, and what it saves a resume.

    python benchmarks/bench_snapshot.py [--rows 100000,1000000] [--backends sqlite,postgresql]

For each backend and row count (the tables of ``bench_datasets.py``, reused when present):

- snapshot: seconds to take it (keys only, keyset pages) and its size in the artifact store;
- start: time to the first row of a new run (take the snapshot, then read the first window);
- resume: time to the first row of a resumed run (read the manifest from the run record,
  restore a mid-epoch state, read the first window: the chunks it needs and nothing else).

Side by side per backend: the smallest and the largest row count, and their ratio. The
resume's ratio stays near 1 (it reads no key of the table); the start's grows with the rows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_datasets import FIELDS, TABLE, prepare  # noqa: E402

import llmtrain as lt  # noqa: E402
from llmtrain.data import RunSnapshot, take_snapshot  # noqa: E402
from llmtrain.stores.artifacts.local import LocalArtifactStore  # noqa: E402


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
    return {"snapshot_s": snap_s, "bytes": size, "start_s": start_s, "resume_s": resume_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args(argv)
    sizes = sorted(int(r) for r in args.rows.split(","))
    print(f"{'backend':<12}{'rows':>12}{'snapshot':>10}{'size':>12}{'start':>10}{'resume':>10}")
    for backend in args.backends.split(","):
        results = {}
        for rows in sizes:
            target = prepare(backend, rows)
            r = results[rows] = measure(target.uri, rows)
            print(
                f"{target.name:<12}{rows:>12,}{r['snapshot_s']:>9.2f}s{r['bytes'] / 1e6:>10.2f}MB"
                f"{r['start_s']:>9.2f}s{r['resume_s'] * 1e3:>8.1f}ms",
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
