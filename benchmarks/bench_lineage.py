"""Lineage and forget at scale, side by side with the raw key read of the table (the floor).

    python benchmarks/bench_lineage.py [--rows 10000000] [--forget 100000] [--small 49]

A real fit (the tiny model, 16 rows, 2 steps) writes a run record; the benchmark's runs are that
record as a fit over the whole table that reached its last step writes it (its snapshot taken
of the table, its steps the epoch's), so ``trained_on`` and ``forget`` do exactly what they do
for such runs; the trainer never trains 10M rows here. Printed, each with its ratio:

- the raw key read of the table (sqlite3, ``SELECT id ORDER BY id``): the floor;
- ``trained_on`` one key with 1 covering run, then with 1 covering run and ``--small`` runs of
  16 rows beside it (a run that holds none of the keys costs one chunk read);
- ``forget`` of ``--forget`` keys with 3 covering runs (goal: at most 10x the raw read);
- the run record's size before and after the forget (a run records counts, never the keys).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import llmtrain as lt
from llmtrain.data.snapshot import take_snapshot
from llmtrain.testing import tiny_model


def table(path: Path, rows: int) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, q TEXT, a TEXT)")
        conn.execute(
            "WITH RECURSIVE s(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x < ?) "
            "INSERT INTO docs SELECT x, 'question ' || x, 'answer ' || (x % 7) FROM s",
            (rows - 1,),
        )


def covering(db: Any, template: Any, select: Any, rows: int) -> str:
    """A run record as a completed fit of ``select`` (every row trained once) writes it."""
    snapshot = take_snapshot(db, select)
    config = json.loads(json.dumps(template.info["config"]))
    config["fit"]["select"] = select.to_dict()
    config["training_args"]["max_steps"] = -1
    config["training_args"]["num_train_epochs"] = 1
    batch = config["training_args"]["per_device_train_batch_size"]
    steps = -(-rows // batch)
    run_id = uuid.uuid4().hex
    info = {**template.info, "config": config, "query": select.to_dict()}
    info |= {"snapshot": snapshot.to_record(), "steps": steps}
    db.metadata.create_run(run_id, "trainer", template.identifier, template.version, info)
    db.metadata.update_run(run_id, status="completed")
    db.metadata.add_component("model", template.identifier, {"run_id": run_id})
    return run_id


def fit(root: Path, db: Any, name: str, select: Any) -> None:
    model = root / "tiny"
    lt.LLMTrainer(
        name,
        model=str(model if model.exists() else tiny_model(model)),
        prompt_template="{X} {Y}",
        batch_size=8,
        num_train_epochs=1,
        progress_bar=False,
    ).fit(X="q", Y="a", db=db, select=select)


def timed(call: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--forget", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=49)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        table(root / "data.db", args.rows)
        db = lt.connect(f"sqlite:///{root / 'data.db'}", artifacts=root / "artifacts")
        small = lt.Table("docs").where("id < 16")
        lt.LLMTrainer(
            "bench",
            model=str(tiny_model(root / "tiny")),
            prompt_template="{X} {Y}",
            batch_size=8,
            num_train_epochs=1,
            progress_bar=False,
        ).fit(X="q", Y="a", db=db, select=small)
        (template,) = db.metadata.list_runs("trainer", "bench")
        floor, _ = timed(
            lambda: (
                sqlite3.connect(root / "data.db")
                .execute("SELECT id FROM docs ORDER BY id")
                .fetchall()
            )
        )
        print(f"raw key read of {args.rows:,} rows: {floor:.2f} s")
        big = covering(db, template, lt.Table("docs"), args.rows)
        key = args.rows // 2 + 7
        one, found = timed(lambda: db.trained_on("docs", key))
        assert found.runs == [big], found
        for _ in range(args.small - 1):  # the real fit's run is one of the small ones
            covering(db, template, small, 16)
        many, found = timed(lambda: db.trained_on("docs", key))
        assert found.runs == [big], found
        print(
            f"trained_on one key, 1 covering run: {one:.3f} s; with {args.small} runs of 16 rows "
            f"beside it: {many:.3f} s (x{many / one:.2f})"
        )
        covering(db, template, lt.Table("docs"), args.rows)
        covering(db, template, lt.Table("docs"), args.rows)
        before = len(json.dumps(template.info))
        step = max(args.rows // args.forget, 1)
        keys = list(range(0, step * args.forget, step))[: args.forget]
        spent, gone = timed(lambda: db.forget("docs", keys))
        print(
            f"forget {len(keys):,} keys, {len(gone.runs)} runs cover them: {spent:.1f} s = "
            f"{spent / floor:.1f}x the raw key read"
        )
        fit(root, db, "after", small)  # a real fit again, recorded with the forget in force
        (later,) = db.metadata.list_runs("trainer", "after")
        size = len(json.dumps(later.info))
        print(f"a 16-row fit's run record: {before:,} bytes before the forget, {size:,} after")
        db.close()


if __name__ == "__main__":
    main()
