"""Nightly incremental fits at scale, side by side with a fresh fit of the same table.

    python benchmarks/bench_incremental.py [--rows 1000000,10000000] [--nights 10] [--new 1000]
                                           [--backends sqlite,postgresql]

For each backend and row count: a fresh fit's time from ``fit()`` to its first optimizer step;
then a trainer whose first run trained the whole table (a real fit of one step, its record's
steps set to the epoch's, so its lineage holds every row), and ``--nights`` incremental fits,
each after ``--new`` rows are inserted (one step of 1024 rows trains them all). Printed: the
fresh fit's and the first and last nights' times to their first step, and the ratios (goals:
the first night within 1.5x of the fresh fit, the last within 1.2x of the first), then every
night's time and the median of the last three over the first three's (a busy machine moves
single fits by 2x).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import llmtrain as lt
from llmtrain.provenance.selection import run_trained
from llmtrain.testing import tiny_model
from llmtrain.training.callbacks import Callback

PG = "postgresql+psycopg://postgres@127.0.0.1:5432"


class FirstStep(Callback):
    at = 0.0

    def on_step(self, run: Any, keys: list[str]) -> None:
        self.at = self.at or time.perf_counter()


def first_step(fit: Any) -> float:
    seen = FirstStep()
    started = time.perf_counter()
    fit(seen)
    return seen.at - started


def trainer(name: str, model: Path) -> lt.LLMTrainer:
    return lt.LLMTrainer(
        name,
        model=str(model),
        prompt_template="Q: {X}\nA: {Y}",
        max_steps=1,
        batch_size=1024,
        progress_bar=False,
        version_column="v",
    )


def database(backend: str, rows: int, root: Path) -> str:
    """A fresh database holding ``docs`` of ``rows`` rows: its URI."""
    series = (
        "generate_series(0, :n) x"
        if backend == "postgresql"
        else "(WITH RECURSIVE s(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x < :n) "
        "SELECT x FROM s)"
    )
    if backend == "postgresql":
        name = f"lt_bench_inc_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(f"{PG}/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        uri = f"{PG}/{name}"
    else:
        uri = f"sqlite:///{root / f'docs-{rows}.db'}"
    with sa.create_engine(uri).begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE docs (id INTEGER PRIMARY KEY, q TEXT, a TEXT, v INTEGER)")
        )
        conn.execute(
            sa.text(
                "INSERT INTO docs SELECT x, 'question ' || x, 'answer ' || (x % 7), 1 "
                f"FROM {series}"
            ),
            {"n": rows - 1},
        )
    return uri


def nights(
    backend: str, rows: int, count: int, new: int, root: Path, model: Path
) -> tuple[float, list[float]]:
    uri = database(backend, rows, root)
    db = lt.connect(uri, artifacts=root / f"artifacts-{backend}-{rows}")
    select = lt.Table("docs")
    fresh = first_step(
        lambda cb: trainer("fresh", model).fit(X="q", Y="a", db=db, select=select, callbacks=[cb])
    )
    trainer("nightly", model).fit(X="q", Y="a", db=db, select=select)
    (run,) = db.metadata.list_runs("trainer", "nightly")
    db.metadata.update_run(run.run_id, info={"steps": -(-rows // 1024), "trained": None})
    run_trained(db, db.metadata.get_run(run.run_id))  # kept as a run that trained them all keeps it
    times, top = [], rows
    for _ in range(count):
        with sa.create_engine(uri).begin() as conn:
            conn.execute(
                sa.text("INSERT INTO docs VALUES (:i, :q, 'new', 1)"),
                [{"i": i, "q": f"question {i}"} for i in range(top, top + new)],
            )
        top += new
        again = db.load("trainer", "nightly")
        times.append(first_step(lambda cb, t=again: t.fit(incremental=True, callbacks=[cb])))
        night = db.metadata.list_runs("trainer", "nightly")[-1]
        assert night.info["incremental"]["new_rows"] == new, night.info["incremental"]
    db.close()
    return fresh, times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--nights", type=int, default=10)
    parser.add_argument("--new", type=int, default=1000)
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = tiny_model(root / "tiny")
        for backend, rows in itertools.product(
            args.backends.split(","), map(int, args.rows.split(","))
        ):
            fresh, times = nights(backend, rows, args.nights, args.new, root, model)
            print(
                f"{backend} {rows:,} rows: fresh fit {fresh:.2f} s to its first step; night 1 "
                f"{times[0]:.2f} s (x{times[0] / fresh:.2f} the fresh fit), night {len(times)} "
                f"{times[-1]:.2f} s (x{times[-1] / times[0]:.2f} night 1); every night: "
                + ", ".join(f"{t:.2f}" for t in times)
                + f"; median of the last 3 / the first 3: x"
                f"{statistics.median(times[-3:]) / statistics.median(times[:3]):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
