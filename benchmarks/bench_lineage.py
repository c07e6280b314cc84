"""Lineage at 1M rows: ``trained_on`` for one key, and streaming a model's whole lineage,
side by side with reading the run's snapshot keys once (the floor both stand on).

No training: the rows go into a SQLite table, a real key snapshot is taken of them
(``take_snapshot``, chunks in the artifact folder), and a run record is written as a fit
writes it (the trainer's config, the query, the snapshot manifest, world size, steps) with
a model pointing at it. What is timed is exactly what ``db.trained_on`` and ``db.lineage``
do with such a record; the trainer never runs.

    python benchmarks/bench_lineage.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path

import llmtrain as lt
from llmtrain.data.snapshot import RunSnapshot, take_snapshot


def build(root: Path, rows: int, world_size: int) -> tuple[lt.Datalayer, int]:
    path = root / "data.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, q TEXT, a TEXT)")
        conn.executemany(
            "INSERT INTO docs VALUES (?, ?, ?)", ((i, f"q{i}", f"a{i}") for i in range(rows))
        )
    db = lt.connect(f"sqlite:///{path}", artifacts=root / "artifacts")
    started = time.perf_counter()
    snapshot = take_snapshot(db, lt.Table("docs"))
    print(f"snapshot of {rows} keys: {time.perf_counter() - started:.2f} s")
    trainer = lt.LLMTrainer(
        "bench",
        model="unused",
        prompt_template="{X} {Y}",
        batch_size=8,
        gradient_accumulation_steps=4,
        cache_size=1024,
        num_train_epochs=1,
    )
    per_rank = rows // world_size
    steps = -(-per_rank // 8) // 4
    run_id = uuid.uuid4().hex
    db.metadata.create_run(
        run_id,
        "trainer",
        "bench",
        0,
        {
            "config": trainer.to_dict(),
            "query": lt.Table("docs").to_dict(),
            "snapshot": snapshot.to_record(),
            "world_size": world_size,
            "steps": steps,
        },
    )
    db.metadata.update_run(run_id, status="completed")
    db.metadata.add_component("model", "bench", {"run_id": run_id})
    return db, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db, steps = build(Path(tmp), args.rows, args.world_size)
        run = db.metadata.list_runs("trainer", "bench")[0]
        snapshot = RunSnapshot.from_record(run.info["snapshot"]).train

        started = time.perf_counter()
        count = sum(1 for _ in snapshot.iter_keys(db.artifacts))
        floor = time.perf_counter() - started

        key = args.rows // 2 + 7
        started = time.perf_counter()
        found = db.trained_on("docs", key)
        one_key = time.perf_counter() - started
        assert len(found.uses) == 1 and found.models == [("bench", 0)], found

        started = time.perf_counter()
        streamed = sum(1 for _ in db.lineage("model", "bench"))
        whole = time.perf_counter() - started
        assert streamed == min(args.rows, steps * 32 * args.world_size), streamed

        print(f"read the snapshot's {count} keys once:  {floor:.3f} s ({count / floor:,.0f}/s)")
        print(f"trained_on(one key):                 {one_key:.3f} s  ratio {one_key / floor:.2f}")
        print(
            f"lineage, {streamed} rows streamed:   {whole:.2f} s ({streamed / whole:,.0f} rows/s)"
            f"  ratio {whole / floor:.1f}"
        )
        db.close()


if __name__ == "__main__":
    main()
