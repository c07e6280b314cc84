"""What a resume meets: rows that changed since the checkpoint, and an artifact store that
cannot take the next checkpoint (disk full, unwritable).

Promises: a resume reads the run's snapshot of its rows, so rows added since are not trained
and rows deleted since are skipped and recorded; a checkpoint that cannot be
written fails the fit with a clear ``CheckpointError``, leaves no partial file, and the
previous checkpoint stays intact and resumable (to the uninterrupted run's adapter, bit for
bit).
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fill
from hooks import KeyTrace

import llmtrain as lt
from llmtrain.data.skips import read_skips
from llmtrain.db.engines import sql_engine
from llmtrain.errors import CheckpointError
from llmtrain.training import run as run_module
from llmtrain.training.checkpoint import verify

from .helpers import adapter, assert_same_weights, doc_rows, trainer

OPTIONS: dict[str, Any] = {"max_steps": 8, "save_steps": 2, "cache_size": 8}


@dataclass
class World:
    db: Any
    root: Path
    reference: dict[str, Any]  # the uninterrupted run's adapter


@pytest.fixture(scope="module")
def world(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("resume-faults")
    uri = f"sqlite:///{root / 'data.db'}"
    fill(uri, "docs", doc_rows(32))
    db = lt.connect(uri, artifacts=root / "artifacts")
    model = trainer(tiny, "straight", **OPTIONS).fit(
        X="instruction", Y="output", db=db, select=lt.Table("docs")
    )
    return World(db, root, adapter(db, model, root))


def fit(world: World, tiny: Path, name: str, **kwargs: Any) -> Any:
    return trainer(tiny, name, **OPTIONS).fit(
        X="instruction", Y="output", db=world.db, select=lt.Table(f"docs_{name}"), **kwargs
    )


def crash_after_checkpoint(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    save = run_module.FitRun.save_checkpoint

    def crash(self: Any) -> Any:
        record = save(self)
        if self.step == step:
            raise KeyboardInterrupt(f"simulated crash after the checkpoint at step {step}")
        return record

    monkeypatch.setattr(run_module.FitRun, "save_checkpoint", crash)


# -- rows that changed between a run and its resume -------------------------------------------
#: each applied to a row the crashed attempt had not read yet ({k}), which the resume reaches
CHANGES = {
    "row deleted": "DELETE FROM {t} WHERE id = {k}",
    "row added": "INSERT INTO {t} (id, instruction, output) VALUES (99, 'x', 'y')",
    "row re-keyed": "UPDATE {t} SET id = 1000 + {k} WHERE id = {k}",
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_reads_the_runs_snapshot_whatever_changed_since(
    world: World,
    tiny: Path,
    change: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "changed" + str(list(CHANGES).index(change))
    table = f"docs_{name}"
    fill(world.db.secret_uri(), table, doc_rows(32))
    crash_after_checkpoint(monkeypatch, 4)
    first = KeyTrace()
    with pytest.raises(KeyboardInterrupt):
        fit(world, tiny, name, callbacks=[first])
    monkeypatch.undo()
    (run,) = world.db.metadata.list_runs("trainer", name)
    checkpoints = [c.step for c in world.db.metadata.list_checkpoints(run.run_id)]
    assert max(checkpoints) == 4 and [e["step"] for e in first.steps] == [1, 2, 3, 4]
    # one epoch of 32 rows in 8 steps: the resume reads exactly the rows not read yet
    unread = sorted({f"int:{i}" for i in range(32)} - set(first.keys), key=lambda k: int(k[4:]))
    assert len(unread) == 16
    key = int(unread[len(unread) // 2][4:])
    with sql_engine(world.db.secret_uri()).begin() as conn:
        conn.execute(sa.text(CHANGES[change].format(t=table, k=key)))

    trace = KeyTrace()
    model = fit(world, tiny, name, resume=True, callbacks=[trace])  # no allow_changed_data
    (run,) = world.db.metadata.list_runs("trainer", name)
    assert run.status == "completed" and model.record.run_id == run.run_id
    assert [e["step"] for e in trace.steps] == list(range(5, OPTIONS["max_steps"] + 1))
    # only the snapshot's rows: an added or re-keyed row is not trained; the deleted one,
    # which the resume would have trained, is skipped and recorded on the run exactly
    gone = [f"int:{key}"] if change != "row added" else []
    assert sorted(trace.keys) == sorted(set(unread) - set(gone))
    assert sorted(read_skips(world.db.artifacts, run.info).deleted) == gone


# -- a checkpoint the artifact store cannot take ----------------------------------------------
class _FullDisk:
    """A file whose writes stop with ENOSPC once ``room`` bytes are written."""

    def __init__(self, raw: Any, room: int) -> None:
        self.raw, self.room = raw, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.raw.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.raw.close()


class _StoreOs:
    """``os`` as the local artifact store sees it, with the disk filling up once armed."""

    def __init__(self, armed: dict[str, bool]) -> None:
        self.armed = armed

    def fdopen(self, fd: int, *args: Any, **kwargs: Any) -> Any:
        raw = os.fdopen(fd, *args, **kwargs)
        return _FullDisk(raw, room=1024) if self.armed["on"] else raw

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


FAULTS = {
    "disk full mid-write": ("ENOSPC", r"disk full\?"),
    "store unwritable": ("EACCES", "Permission denied"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_checkpoint_the_store_cannot_take_fails_clearly_and_the_last_one_resumes(
    world: World, tiny: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmtrain.stores.artifacts import local

    name = "store" + str(list(FAULTS).index(fault))
    fill(world.db.secret_uri(), f"docs_{name}", doc_rows(32))
    armed = {"on": False}
    kind, message = FAULTS[fault]
    if kind == "ENOSPC":
        monkeypatch.setattr(local, "os", _StoreOs(armed))
    else:
        mkstemp = tempfile.mkstemp

        def unwritable(*args: Any, **kwargs: Any) -> Any:
            if armed["on"]:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs.get("dir"))
            return mkstemp(*args, **kwargs)

        monkeypatch.setattr(local.tempfile, "mkstemp", unwritable)
    save = run_module.FitRun.save_checkpoint

    def fill_the_disk_after_step_2(self: Any) -> Any:
        armed["on"] = self.step > 2
        return save(self)

    monkeypatch.setattr(run_module.FitRun, "save_checkpoint", fill_the_disk_after_step_2)
    with pytest.raises(CheckpointError, match="checkpoint at step 4") as failed:
        fit(world, tiny, name)
    text = str(failed.value)
    assert "the previous checkpoint is intact" in text
    assert re.search(message, text), text
    monkeypatch.undo()

    db = world.db
    (run,) = db.metadata.list_runs("trainer", name)
    assert run.status == "failed" and "CheckpointError" in (run.error or "")
    (last,) = db.metadata.list_checkpoints(run.run_id)
    assert last.step == 2
    assert not list(Path(db.artifacts.root).rglob(".tmp-*"))  # no partial file is left
    verify(db.artifacts.get_dir(last.artifact_id, world.root / f"{name}-step2"))

    resumed = fit(world, tiny, name, resume=True)
    (run,) = db.metadata.list_runs("trainer", name)
    assert run.status == "completed" and resumed.record.run_id == run.run_id
    assert_same_weights(world.reference, adapter(db, resumed, world.root))
