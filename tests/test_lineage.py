"""Lineage is derived from the record, and it must equal what the loop itself trained on (the
KeyTrace callback): after a crash and a resume, across epochs whose steps straddle the epoch
boundary, and across an incremental run; trained_on and forget agree with it; an incremental
fit trains exactly the new and changed rows, from the parent's weights.

One scenario, one tiny model, 4 short fits (the 2-rank case lives in test_distributed.py,
where a 2-process run with a trace already exists)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from conftest import fill
from hooks import KeyTrace, crash_after_checkpoint
from safetensors.torch import load_file

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.db.keys import key_repr

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
# 18 rows, batches of 2, 2 batches a step: 5 steps an epoch, its last of 2 rows; blocks of 4
# rows shuffled; 2 epochs = 10 steps
OPTIONS: dict[str, Any] = {
    "num_train_epochs": 2,
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "cache_size": 3,
    "shuffle_block": 4,
    "shuffle": True,
    "seed": 3,
    "save_steps": 3,
    "learning_rate": 1e-2,
    "lora_r": 4,
    "lora_dropout": 0.0,
    "progress_bar": False,
    "version_column": "updated",
}


def _row(i: int, updated: int = 1) -> dict[str, Any]:
    return {"id": i, "q": f"What is color number {i % 8}?", "a": COLORS[i % 8], "updated": updated}


def _trace_rows(trace: KeyTrace) -> list[tuple[str, int]]:
    """(key, step) the loop trained, the last attempt of a step winning (a resume redoes
    the steps after its checkpoint)."""
    by_step: dict[int, list[str]] = {}
    for entry in trace.steps:
        by_step[entry["step"]] = entry["keys"]
    return sorted((k, s) for s, keys in by_step.items() for k in keys)


def _lineage(db: Any, name: str, version: int | None = None) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for row in db.lineage("model", name, version):
        out[row.run_id].append((key_repr(row.key), row.step))
    return {run: sorted(rows) for run, rows in out.items()}


def _adapter(db: Any, artifact: str, folder: Path) -> dict[str, torch.Tensor]:
    db.artifacts.get_dir(artifact, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


def test_lineage_equals_the_trace_through_resume_incremental_and_forget(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [_row(i) for i in range(18)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    where = ["--db", uri, "--artifacts", str(tmp_path / "artifacts")]
    trainer = lt.LLMTrainer("lin", model=tiny, prompt_template=TEMPLATE, **OPTIONS)

    # a run that crashes after its step-6 checkpoint, then resumes

    first = KeyTrace()
    undo = crash_after_checkpoint(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"), callbacks=[first])
    undo()
    parent = db.load("trainer", "lin").fit(resume=True, callbacks=[first])
    (run,) = db.metadata.list_runs("trainer", "lin")
    assert run.status == "completed" and run.info["steps"] == 10
    trained = _trace_rows(first)
    assert len(trained) == 36 and {s for _, s in trained} == set(range(1, 11))
    assert _lineage(db, "lin") == {run.run_id: trained}

    # rows arrive and one changes in place (new text, new version): an incremental fit
    # trains on exactly those, from the parent's adapter, and records the parent
    engine = sa.create_engine(uri)
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO docs (id, q, a, updated) VALUES (:id, :q, :a, :updated)"),
            [_row(i) for i in range(18, 24)],
        )
        conn.execute(sa.text("UPDATE docs SET a = 'purple', updated = 2 WHERE id = 5"))
    engine.dispose()
    second = KeyTrace()
    child = db.load("trainer", "lin").fit(incremental=True, callbacks=[second])
    assert child.version == parent.version + 1 and child.identifier == "lin"
    new_run = db.metadata.get_run(child.record.run_id)
    assert new_run.info["parent"]["run_id"] == run.run_id
    assert new_run.info["parent"]["model_version"] == parent.version
    assert new_run.info["incremental"]["new_rows"] == 7
    assert "incremental" not in db.load("trainer", "lin").to_dict()  # not in the recipe
    new_keys = {k for k, _ in _trace_rows(second)}
    assert new_keys == {f"int:{i}" for i in [5, *range(18, 24)]}
    assert _lineage(db, "lin") == {run.run_id: trained, new_run.run_id: _trace_rows(second)}
    assert _lineage(db, "lin", parent.version) == {run.run_id: trained}

    # it started from the parent's weights: set up the same run again and look before step 1
    from llmtrain.training.plan import RunPlan
    from llmtrain.training.run import FitRun
    from llmtrain.training.strategies import make_strategy

    probe = FitRun(RunPlan.from_record(new_run), db, make_strategy("single"))
    probe.setup()
    try:
        from peft import get_peft_model_state_dict

        start = get_peft_model_state_dict(probe.model)
    finally:
        probe.cleanup()
    before = _adapter(db, parent.record.adapter, tmp_path / "parent")
    assert before.keys() == start.keys()
    for name in before:
        torch.testing.assert_close(start[name], before[name], rtol=0, atol=0)

    # trained_on agrees with the trace: the runs and steps, the checkpoints at or after the
    # first step, the parent's model and the model continued from it
    key = trained[0][0]
    steps = sorted(s for k, s in trained if k == key)
    found = db.trained_on("docs", int(key.split(":")[1]))
    assert [(u.run_id, u.step) for u in found.uses] == [(run.run_id, s) for s in steps]
    assert found.runs == [run.run_id, new_run.run_id]
    assert {(c.run_id, c.step) for c in found.checkpoints} >= {
        (run.run_id, c.step) for c in db.metadata.list_checkpoints(run.run_id) if c.step >= steps[0]
    }
    assert sorted(found.models) == [("lin", parent.version), ("lin", child.version)]
    assert db.trained_on("docs", 10_000).runs == [] and not db.trained_on("docs", 10_000)
    assert found and found.forgotten == []

    # the CLI says the same
    assert main(["trained-on", "docs", key.split(":")[1], *where]) == 0
    assert run.run_id in capsys.readouterr().out
    assert main(["lineage", "lin", "--version", str(parent.version), *where]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted((f"int:{ln.split()[0]}", int(ln.split()[2])) for ln in lines) == trained
    assert main(["lineage", "nope", *where]) == 2

    # forget the row: the models are reported and the runs marked, nothing deleted; the
    # retrain leaves the row out and records so, and a later run does too
    forgotten = db.forget("docs", [int(key.split(":")[1])])
    assert sorted(forgotten.models) == sorted(found.models)
    assert forgotten.trainers == [("lin", run.version)]
    from llmtrain.provenance.lineage import forgotten as forget_records

    carried = forget_records(db, None)[1]  # one record of the forget: runs are not rewritten
    assert carried[run.run_id] == [key] and carried[new_run.run_id] == [key]
    assert "forgotten_keys" not in db.metadata.get_run(run.run_id).info
    assert db.trained_on("docs", int(key.split(":")[1])).forgotten == [int(key.split(":")[1])]
    assert db.load("model", "lin", parent.version).record.adapter == parent.record.adapter
    assert main(["show", "model", "lin", *where]) == 0
    assert "FORGOTTEN ROWS" in capsys.readouterr().out.upper()
    third = KeyTrace()
    (retrained,) = forgotten.retrain(callbacks=[third])
    retrain_run = db.metadata.get_run(retrained.record.run_id)
    assert retrain_run.info["forgets"]["main.docs(id)"]["keys"] == 1
    assert "parent" not in retrain_run.info
    assert key not in {k for k, _ in _trace_rows(third)}
    assert len({k for k, _ in _trace_rows(third)}) == 23
    assert _lineage(db, "lin") == {retrain_run.run_id: _trace_rows(third)}

    # the CLI: forget lists what trained on a row; user mistakes exit 2
    other = next(k for k, _ in _trace_rows(third)).split(":")[1]
    assert main(["forget", "docs", other, *where]) == 0
    out = capsys.readouterr().out
    assert retrain_run.run_id in out and f"lin v{retrained.version}" in out
    assert main(["trained-on", "docs", other, *where]) == 0
    assert f"forgotten (db.forget): {other}" in capsys.readouterr().out
    assert main(["trained-on", "docs", other]) == 2  # no --db
    assert "no database" in capsys.readouterr().err
    db.close()


def _keys_only(rows: list[Any]) -> list[Any]:
    return [k for k, _ in rows]


def test_rows_deleted_mid_run_leave_the_lineage_in_the_epochs_they_were_gone(
    tmp_path: Path,
) -> None:
    """No model: the real dataset and loader read 3 shuffled epochs while a whole block and a
    single row are deleted after epoch 0; the batches it yields, numbered by the step rule,
    are the lineage derived from the record of the skips."""
    from llmtrain.data import CachedQueryDataset
    from llmtrain.data.plan import StepRule
    from llmtrain.data.skips import Skips
    from llmtrain.data.snapshot import take_snapshot
    from llmtrain.provenance.lineage import RunLineage, find

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [_row(i) for i in range(20)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    snapshot = take_snapshot(db, lt.Table("docs"))
    data = CachedQueryDataset(
        db,
        lt.Table("docs"),
        ["q"],
        cache_size=3,
        shuffle_block=4,
        seed=5,
        rank=0,
        world_size=1,
        snapshot=snapshot,
    )
    rule = StepRule(data.order, rows=6, micro=2)
    # one worker process reads the rows: the skips it sees reach the record all the same
    loader = data.loader(2, num_workers=1, with_keys=True, collate_fn=_keys_only)
    expected, skips = [], Skips()
    for epoch in range(3):
        loader.set_epoch(epoch)
        for made in loader.batches():
            step = int(rule.steps(epoch, made.first))
            expected += [(key_repr(k), epoch, step) for k in made.batch or []]
            skips.add(made.skipped, epoch, made.deleted)
        if epoch == 0:
            engine = sa.create_engine(uri)
            with engine.begin() as conn:
                conn.execute(sa.text("DELETE FROM docs WHERE id IN (8, 9, 10, 11, 17)"))
            engine.dispose()
    assert len(expected) == 20 + 2 * 15
    assert {k: e for k, e in skips.skipped.values()} == {k: {1, 2} for k in (8, 9, 10, 11, 17)}
    assert sorted(skips.deleted.values()) == [8, 9, 10, 11, 17]
    view = snapshot.train
    epochs = {k: e for k, e in skips.skipped.values()}
    skipped = {i: epochs[k] for k, i in find(view, db.artifacts, list(epochs))}
    derived = RunLineage("r", view, db.artifacts, rule, 3 * rule.per_epoch, skipped)
    rows = sorted((key_repr(r.key), r.epoch, r.step) for r in derived.rows())
    assert rows == sorted(expected)
    db.close()
