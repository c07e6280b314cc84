"""Training on a table another process keeps writing to (PostgreSQL, serial and UUID keys).

Promises: a run trains its snapshot of the selection's keys, taken when it starts: rows
inserted during the run are not trained, rows deleted during the run are skipped, counted and
recorded on the run, every other row is trained once per epoch; a resume after kill -9 reads
the run's snapshot from its record (no scan of the keys) and continues batch for batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fresh_database
from faults.helpers import trainer
from faults.test_kill_resume import finish, kill_when_held, launch, read_trace

import llmtrain as lt
from llmtrain.data import RunSnapshot
from llmtrain.data.skips import read_skips
from llmtrain.db.keys import key_repr
from llmtrain.training.callbacks import Callback

#: the writer: inserts a row every few ms (and deletes it again a little later); once
#: ``go`` exists it also deletes the rows named in ``doomed``, one every few ms; it notes
#: every row it inserts (``inserted``) and deletes (``gone``)
WRITER = r"""
import json, os, random, sys, time, uuid
import sqlalchemy as sa
uri, table, kind, doomed, go, gone, inserted = sys.argv[1:]
doomed = json.loads(doomed)
engine = sa.create_engine(uri, isolation_level="AUTOCOMMIT")
mine, deadline = [], time.monotonic() + 120
with engine.connect() as conn:
    while time.monotonic() < deadline:
        key = str(uuid.uuid4()) if kind == "uuid" else None
        cols = "(id, instruction, output)" if key else "(instruction, output)"
        vals = "(:k, 'new row', 'new')" if key else "('new row', 'new')"
        new = conn.execute(sa.text(f"INSERT INTO {table} {cols} VALUES {vals} RETURNING id"),
                           {"k": key}).scalar()
        with open(inserted, "a") as fh:
            fh.write(f"{new}\n")
        mine.append(new)
        drop = [mine.pop(0)] if len(mine) > 5 else []
        if doomed and os.path.exists(go):
            drop.append(doomed.pop())
        for key in drop:
            conn.execute(sa.text(f"DELETE FROM {table} WHERE id = :k"), {"k": key})
            with open(gone, "a") as fh:
                fh.write(json.dumps(str(key)) + "\n")
        time.sleep(0.003)
"""


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[str]:
    yield from fresh_database("postgresql", tmp_path)


def make_table(uri: str, kind: str, n: int) -> list[Any]:
    """``docs`` with ``n`` rows keyed by a serial int or a uuid; returns the keys."""
    key = "id uuid PRIMARY KEY" if kind == "uuid" else "id serial PRIMARY KEY"
    with sa.create_engine(uri).begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE docs ({key}, instruction text, output text)"))
        keys = [uuid.uuid4() if kind == "uuid" else i + 1 for i in range(n)]
        conn.execute(
            sa.text("INSERT INTO docs (id, instruction, output) VALUES (:id, :i, :o)"),
            [
                {"id": k, "i": f"What is color {j % 8}?", "o": f"color {j % 8}"}
                for j, k in enumerate(keys)
            ],
        )
        if kind == "serial":
            conn.execute(sa.text("SELECT setval('docs_id_seq', :n)"), {"n": n})
    return keys


def wait_for(done: Any, what: str, proc: Any, timeout_s: float = 30) -> None:
    """Poll ``done()`` until true; fail naming ``what`` if the writer died or time ran out."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, f"the writer process died before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)


class Writer:
    def __init__(self, uri: str, kind: str, doomed: list[Any], root: Path) -> None:
        self.go, self.gone, self.inserted = root / "go", root / "gone", root / "inserted"
        args = [uri, "docs", kind, json.dumps([str(k) if kind == "uuid" else k for k in doomed])]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, *args, *map(str, (self.go, self.gone, self.inserted))]
        )
        wait_for(lambda: self.inserted.exists(), "the writer's first insert", self.proc)

    def wait_deleted(self, keys: set[str], count: int) -> set[str]:
        """Wait (bounded) until ``count`` of ``keys`` are deleted; those deleted by then."""
        wait_for(lambda: len(self.deleted() & keys) >= count, f"{count} deletes", self.proc)
        return self.deleted() & keys

    def deleted(self) -> set[str]:
        if not self.gone.exists():
            return set()
        return {json.loads(line) for line in self.gone.read_text().splitlines()}

    def stop(self) -> set[str]:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        return set(self.inserted.read_text().split())


def snapshot_keys(db: Any, run: Any) -> list[str]:
    snapshot = RunSnapshot.from_record(run.info["snapshot"])
    return [key_repr(k) for k in snapshot.train.iter_keys(db.artifacts)]


def plain(key: str) -> str:
    """A traced key (``int:5`` or a uuid's text) as the writer names it."""
    return key.removeprefix("int:").removeprefix("UUID:")


class EpochTrace(Callback):
    """Keys per epoch; at the first step it lets the writer delete rows and waits until it
    has, so rows are deleted while the run trains, before the second epoch reads them."""

    def __init__(self, writer: Writer, doomed: list[Any]) -> None:
        self.writer, self.epochs = writer, Counter[tuple[int, str]]()
        self.doomed = {str(k) for k in doomed}
        self.deleted_mid_run: set[str] = set()  # doomed rows gone before epoch 1 read them

    def on_step(self, run: Any, keys: list[str]) -> None:
        epoch = (run.step - 1) // len(run.batches)  # steps per epoch
        self.epochs.update((epoch, k) for k in keys)
        if run.step == 1:
            self.writer.go.touch()
            self.deleted_mid_run = self.writer.wait_deleted(self.doomed, 3)


@pytest.mark.parametrize("kind", ["serial", "uuid"])
def test_a_fit_on_a_live_table_trains_its_snapshot_once_per_epoch(
    pg: str, tiny: Path, tmp_path: Path, kind: str
) -> None:
    keys = make_table(pg, kind, 16)
    writer = Writer(pg, kind, keys[::4], tmp_path)  # 4 rows doomed
    trace = EpochTrace(writer, keys[::4])
    try:
        db = lt.connect(pg, artifacts=tmp_path / "artifacts")
        t = trainer(tiny, f"live{kind}", max_steps=-1, num_train_epochs=2, cache_size=8)
        t.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"), callbacks=[trace])
    finally:
        inserted = writer.stop()
    (run,) = db.metadata.list_runs("trainer", f"live{kind}")
    assert run.status == "completed"
    snapshot = snapshot_keys(db, run)
    recorded = set(read_skips(db.artifacts, run.info).deleted)  # as key_repr
    deleted = {k for k in snapshot if plain(k) in writer.deleted()}
    # the doomed rows deleted during epoch 0 were in the snapshot, and the second epoch would
    # have read them: each was skipped and recorded (not only the writer's own rows)
    mid_run = {k for k in snapshot if plain(k) in trace.deleted_mid_run}
    assert len(mid_run) >= 3 and mid_run <= recorded
    assert recorded <= deleted and run.info["deleted_rows"] == len(recorded)
    for epoch in (0, 1):
        trained = {k for (e, k), n in trace.epochs.items() if e == epoch}
        assert all(n == 1 for (e, _), n in trace.epochs.items() if e == epoch)
        # each epoch: the snapshot's rows minus the deleted ones (drop_remainder: none here)
        assert trained <= set(snapshot) and set(snapshot) - trained <= recorded
    # rows inserted after the snapshot (the writer kept inserting) are not trained
    new = inserted - {plain(k) for k in snapshot}
    assert new and not {plain(k) for _, k in trace.epochs} & new
    assert set(snapshot) - recorded <= {k for (e, k) in trace.epochs if e == 1}


@pytest.mark.slow
def test_a_resume_after_kill_9_reads_the_snapshot_and_continues_batch_for_batch(
    pg: str, tiny: Path, tmp_path: Path
) -> None:
    keys = make_table(pg, "uuid", 32)
    writer = Writer(pg, "uuid", keys[::4], tmp_path)  # 8 rows doomed
    base = {
        "uri": pg,
        "artifacts": str(tmp_path / "artifacts"),
        "model": str(tiny),
        "identifier": "livekill",
        "count_key_pages": True,
        "options": {"max_steps": 12, "save_steps": 3, "cache_size": 8, "progress_bar": False},
    }
    try:
        hold = {"kind": "after-step", "step": 5, "marker": str(tmp_path / "first.held")}
        first = launch({**base, "hold": hold}, tmp_path / "first", tmp_path / "first.first.log")
        kill_when_held({"first": first}, tmp_path)
        first.wait(timeout=30)
        writer.go.touch()  # rows deleted between the kill and the resume
        assert len(writer.wait_deleted({str(k) for k in keys[::4]}, 8)) == 8
        resumed = launch({**base, "resume": True}, tmp_path / "resumed", tmp_path / "resumed.log")
        result = finish(resumed, tmp_path / "resumed.log")
    finally:
        inserted = writer.stop()
    assert result["key_pages"] == 0  # the resume took no snapshot: it read the run's
    db = lt.connect(pg, artifacts=tmp_path / "artifacts")
    (run,) = db.metadata.list_runs("trainer", "livekill")
    assert run.status == "completed" and run.run_id == result["run_id"]
    snapshot = set(snapshot_keys(db, run))
    recorded = set(read_skips(db.artifacts, run.info).deleted)  # as key_repr
    assert recorded and {plain(k) for k in recorded} <= writer.deleted()
    before, after = dict(read_trace(tmp_path / "first")), dict(read_trace(tmp_path / "resumed"))
    # every doomed row the first attempt had not trained by its checkpoint (step 3) comes in
    # the rest of epoch 0: gone before the resume, each is skipped and recorded
    doomed = {k for k in snapshot if plain(k) in {str(d) for d in keys[::4]}}
    unread = doomed - {k for s in (1, 2, 3) for k in before[s]}
    assert unread and unread <= recorded
    assert sorted(after) == list(range(4, 13))  # from the checkpoint at step 3 on
    for step in (4, 5):  # the steps the killed run took again: the same rows, less deleted
        assert after[step] == [k for k in before[step] if k not in recorded]
    trained = [k for s in sorted(after) for k in after[s]] + [
        k for s in (1, 2, 3) for k in before[s]
    ]
    new = inserted - {plain(k) for k in snapshot}  # inserted after the snapshot was taken
    assert new and set(trained) <= snapshot and not {plain(k) for k in trained} & new
    # every doomed row was gone before the resume started: it trained none of them
    assert not {k for keys in after.values() for k in keys} & recorded
