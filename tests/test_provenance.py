"""Records you can trust (issue 9, provenance): a resume continues only its own recipe's run,
a run's terminal status changes only through its own work, a fit that cannot train records
nothing, replays keep their version, a step's metrics are stored once, a fit that trains
nothing fails, and an interrupted run says so with the steps it reached."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fill

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.errors import ConfigError, DataError, LlmtrainError, QueryError
from llmtrain.stores.metadata import MetadataStore, open_metadata
from llmtrain.training import run as run_module

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
ROWS = [
    {"id": i, "instruction": f"What is color number {i % 8}?", "output": COLORS[i % 8]}
    for i in range(24)
]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Any]:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", ROWS)
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    yield db
    db.close()


def _trainer(tiny: Path | str, name: str = "prov", **kwargs: Any) -> lt.LLMTrainer:
    options: dict[str, Any] = {
        "max_steps": 4,
        "batch_size": 4,
        "learning_rate": 1e-2,
        "lora_r": 4,
        "progress_bar": False,
        "logging_steps": 1,
        "save_steps": 2,
    }
    options.update(kwargs)
    return lt.LLMTrainer(name, model=str(tiny), prompt_template=TEMPLATE, **options)


def _fit(trainer: lt.LLMTrainer, db: Any, select: Any = None, **kwargs: Any) -> Any:
    return trainer.fit(
        X=kwargs.pop("X", "instruction"),
        Y=kwargs.pop("Y", "output"),
        db=db,
        select=select if select is not None else lt.Table("docs"),
        **kwargs,
    )


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Ctrl-C right after ``step`` logged its metrics (after the checkpoint before it)."""
    original = run_module.FitRun._log

    def log_then_interrupt(self: Any, metrics: dict[str, float]) -> None:
        original(self, metrics)
        if self.step == step and "loss" in metrics:
            raise KeyboardInterrupt

    monkeypatch.setattr(run_module.FitRun, "_log", log_then_interrupt)


def _versions(db: Any, name: str = "prov") -> list[int]:
    return db.show("trainer", name) if name in db.show("trainer") else []


# -- 1. a resume continues only a run of the same recipe --------------------------------------
def test_resume_refuses_a_run_of_another_version_and_records_nothing(tiny: Path, db: Any) -> None:
    _fit(_trainer(tiny), db)
    (before,) = db.metadata.list_runs("trainer", "prov")
    changed = _trainer(tiny, learning_rate=0.5, max_steps=6)
    with pytest.raises(ConfigError, match=r"is of trainer 'prov' v0, but this recipe is a new"):
        _fit(changed, db, resume=True)
    (after,) = db.metadata.list_runs("trainer", "prov")
    assert after.status == "completed" and after.info["steps"] == 4 == before.info["steps"]
    assert _versions(db) == [0] and db.show("model", "prov") == [0]
    # without resume= the new recipe trains a fresh run of its own version
    model = _fit(changed, db)
    runs = db.metadata.list_runs("trainer", "prov")
    assert [r.version for r in runs] == [0, 1] and model.record.trainer_version == 1
    assert model.record.run_id == runs[-1].run_id and runs[-1].info["steps"] == 6
    # and the old version can still be resumed by loading it: complete, nothing to do
    old = db.load("trainer", "prov", version=0)
    again = old.fit(resume=True)
    assert again.record.run_id == before.run_id and again.version == 0


def test_resuming_a_completed_run_trains_nothing_and_returns_its_model(tiny: Path, db: Any) -> None:
    model = _fit(_trainer(tiny), db)
    (run,) = db.metadata.list_runs("trainer", "prov")
    metrics = db.metadata.get_metrics(run.run_id)
    with sa.create_engine(db.uri).begin() as conn:  # rows changed: a resume would refuse
        conn.execute(sa.text("DELETE FROM docs WHERE id = 1"))
    again = _fit(_trainer(tiny), db, resume=True)
    assert again.record.run_id == run.run_id and again.version == model.version
    (after,) = db.metadata.list_runs("trainer", "prov")
    assert after.status == "completed" and after.error is None
    assert after.info["steps"] == 4 and db.metadata.get_metrics(run.run_id) == metrics
    assert db.show("model", "prov") == [0]


def test_cli_replay_resume_of_a_broken_version_does_not_resume_another(
    tiny: Path, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(_trainer(tiny), db)  # v0, completed
    with pytest.raises(QueryError):
        _fit(_trainer(tiny, max_steps=6), db, X="missing")  # v1 would read a missing column
    assert _versions(db) == [0]
    # a stored v1 whose X column does not exist (stored before checks existed, say)
    broken = _trainer(tiny, max_steps=6)
    broken.config.fit = db.load("trainer", "prov").config.fit.model_copy(update={"X": "missing"})
    db.add(broken)
    assert _versions(db) == [0, 1]
    code = main(["replay", "prov", "--resume", "--db", db.uri, "--artifacts", str(_art(db))])
    _, err = capsys.readouterr()
    assert code != 0 and "missing" in err
    (run,) = db.metadata.list_runs("trainer", "prov")
    assert run.version == 0 and run.status == "completed" and run.info["steps"] == 4
    assert db.show("model", "prov") == [0]


def _art(db: Any) -> Path:
    return Path(db.artifacts.root)


# -- 2. a failed attempt never rewrites a run's terminal status -------------------------------
def test_an_interrupt_after_the_run_completed_leaves_it_completed(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = type(db.metadata).update_run

    def interrupt_once_completed(self: Any, run_id: str, **changes: Any) -> Any:
        record = original(self, run_id, **changes)
        if changes.get("status") == "completed":  # Ctrl-C lands just after the work is done
            raise KeyboardInterrupt
        return record

    monkeypatch.setattr(type(db.metadata), "update_run", interrupt_once_completed)
    with pytest.raises(KeyboardInterrupt):
        _fit(_trainer(tiny), db)
    (run,) = db.metadata.list_runs("trainer", "prov")
    assert run.status == "completed" and run.error is None and run.info["steps"] == 4


def test_a_resume_that_cannot_start_leaves_the_run_as_it_was(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _fit(_trainer(tiny), db)
    monkeypatch.undo()
    (before,) = db.metadata.list_runs("trainer", "prov")
    assert before.status == "interrupted"
    (checkpoint,) = db.metadata.list_checkpoints(before.run_id)[-1:]
    db.artifacts.delete(checkpoint.artifact_id)  # the checkpoint to resume from is gone
    with pytest.raises(LlmtrainError):
        _fit(_trainer(tiny), db, resume=True)
    (after,) = db.metadata.list_runs("trainer", "prov")
    assert (after.status, after.info) == (before.status, before.info) == ("interrupted", after.info)
    assert after.error.startswith("resume refused: ")


# -- 3. a fit that cannot train records nothing; replays keep their version ---------------------
@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("mistyped X", QueryError, "no column 'instrution'"),
        ("missing model", ConfigError, "no model folder"),
        ("not a model folder", ConfigError, "no config.json"),
        ("unmatched target", ConfigError, r"\['qkv'\] match no linear layer"),
        ("empty selection", DataError, "selects 0 rows"),
    ],
)
def test_a_fit_that_cannot_train_records_no_version_and_no_run(
    tiny: Path, db: Any, tmp_path: Path, case: str, error: type, message: str
) -> None:
    model: Path | str = tiny
    options: dict[str, Any] = {}
    fit: dict[str, Any] = {}
    if case == "mistyped X":
        fit["X"] = "instrution"
    elif case == "missing model":
        model = tmp_path / "no-such-model"
    elif case == "not a model folder":
        model = tmp_path / "empty"
        model.mkdir()
    elif case == "unmatched target":
        options["target_modules"] = ["qkv"]
    else:
        fit["select"] = lt.Table("docs").where("id < 0")
    for _ in range(3):  # each attempt records nothing, so nothing piles up
        with pytest.raises(error, match=message):
            _fit(_trainer(model, **options), db, **fit)
    assert db.show("trainer") == [] and db.metadata.list_runs() == []


def test_a_field_missing_from_mongo_documents_records_nothing(tiny: Path, tmp_path: Path) -> None:
    uri = f"mongomock://localhost/prov_{os.getpid()}"
    fill(uri, "docs", ROWS)
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    with pytest.raises(ConfigError, match=r"fit\(Y='answer'\): no field 'answer'"):
        _fit(_trainer(tiny), db, lt.Collection("docs"), Y="answer")
    assert db.show("trainer") == [] and db.metadata.list_runs() == []


def test_replaying_an_older_version_records_its_run_under_that_version(tiny: Path, db: Any) -> None:
    _fit(_trainer(tiny), db)
    _fit(_trainer(tiny, learning_rate=2e-2), db)
    assert _versions(db) == [0, 1]
    model = db.load("trainer", "prov", version=0).fit()
    assert _versions(db) == [0, 1]
    assert db.metadata.get_run(model.record.run_id).version == 0
    assert model.record.trainer_version == 0


def test_a_replay_through_a_relative_sqlite_uri_keeps_the_version(
    tiny: Path, db: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(_trainer(tiny), db)
    _fit(_trainer(tiny, learning_rate=2e-2), db)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        args = ["--db", "sqlite:///data.db", "--artifacts", "artifacts"]
        assert main(["replay", "prov", "--version", "0", *args]) == 0
    finally:
        os.chdir(cwd)
    out, _ = capsys.readouterr()
    assert "replaying prov v0" in out and "stored trainer prov v0 and model" in out
    assert _versions(db) == [0, 1]
    assert [r.version for r in db.metadata.list_runs("trainer", "prov")] == [0, 1, 0]


# -- 4. a step's metrics are stored once --------------------------------------------------------
@pytest.fixture
def store(any_uri: str) -> Iterator[MetadataStore]:
    store = open_metadata(any_uri)
    yield store
    store.close()


def test_logging_a_step_again_replaces_its_metrics(store: MetadataStore) -> None:
    store.log_metrics("r", 1, {"loss": 1.0})
    store.log_metrics("r", 2, {"loss": 0.5, "lr": 0.1})
    store.log_metrics("r", 2, {"eval_loss": 0.7})
    store.log_metrics("r", 2, {"loss": 0.4, "lr": 0.2})  # the step redone after a resume
    store.log_metrics("r", 2, {"eval_loss": 0.6})
    store.log_metrics("other", 2, {"loss": 9.0})
    got = [(m.step, m.values) for m in store.get_metrics("r")]
    assert got == [(1, {"loss": 1.0}), (2, {"loss": 0.4, "lr": 0.2}), (2, {"eval_loss": 0.6})]
    store.log_metrics("r", 1, {"lr": 0.3})  # another metric of a step joins it
    assert [m.values for m in store.get_metrics("r")][:2] == [{"loss": 1.0}, {"lr": 0.3}]
    assert [m.values for m in store.get_metrics("other")] == [{"loss": 9.0}]


def test_a_resumed_run_lists_each_step_once(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _interrupt_at(monkeypatch, 3)  # the checkpoint is at step 2: step 3 is done twice
    with pytest.raises(KeyboardInterrupt):
        _fit(_trainer(tiny), db)
    monkeypatch.undo()
    model = _fit(_trainer(tiny), db, resume=True)
    steps = [m.step for m in db.metadata.get_metrics(model.record.run_id) if "loss" in m.values]
    assert steps == [1, 2, 3, 4]


# -- 5. a fit that trains nothing fails ---------------------------------------------------------
def test_a_fit_whose_every_row_is_skipped_fails_and_logs_each_row_once(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"sqlite:///{tmp_path / 'bad.db'}"
    fill(uri, "docs", [{"id": i, "instruction": f"q{i}", "output": None} for i in range(12)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    caplog.set_level(logging.WARNING, logger="llmtrain")
    with pytest.raises(
        DataError,
        match=r"no example was trained: 12 row\(s\) skipped as bad \(keys int:\d+, int:\d+",
    ):
        _fit(_trainer(tiny, on_bad_row="skip"), db)
    (run,) = db.metadata.list_runs("trainer", "prov")
    assert run.status == "failed" and "no example was trained" in run.error
    assert db.show("model") == []
    skips = Counter(r.getMessage() for r in caplog.records if "skipping row" in r.getMessage())
    assert len(skips) == 12 and set(skips.values()) == {1}


def test_skipped_rows_are_logged_once_per_run_not_per_epoch(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"sqlite:///{tmp_path / 'some.db'}"
    rows = [{**r, "output": None if r["id"] % 6 == 0 else r["output"]} for r in ROWS]
    fill(uri, "docs", rows)
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    caplog.set_level(logging.WARNING, logger="llmtrain")
    _fit(_trainer(tiny, on_bad_row="skip", max_steps=15), db)  # 5 batches an epoch: 3 epochs
    skips = Counter(r.getMessage() for r in caplog.records if "skipping row" in r.getMessage())
    assert len(skips) == 4 and set(skips.values()) == {1}


# -- 6. interrupted runs, and fit(db=) of the wrong type ----------------------------------------
def test_an_interrupted_run_says_so_with_the_steps_and_tokens_it_reached(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _fit(_trainer(tiny), db)
    (run,) = db.metadata.list_runs("trainer", "prov")
    assert run.status == "interrupted" and run.error == "KeyboardInterrupt"
    assert run.info["steps"] == 3 and run.info["tokens"] > 0


SIGTERM_FIT = """
import os, signal, sys
import llmtrain as lt
from llmtrain.training import run as run_module

original = run_module.FitRun._log

def log_then_terminate(self, metrics):
    original(self, metrics)
    if self.step == 3 and "loss" in metrics:
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stopping the job would

run_module.FitRun._log = log_then_terminate
db = lt.connect(sys.argv[1], artifacts=sys.argv[2])
trainer = lt.LLMTrainer(
    "prov", model=sys.argv[3], prompt_template=sys.argv[4], max_steps=6, batch_size=4,
    lora_r=4, progress_bar=False, logging_steps=1, save_steps=2,
)
trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
"""


def test_a_fit_stopped_by_sigterm_is_recorded_as_interrupted(
    tiny: Path, db: Any, tmp_path: Path
) -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-c", SIGTERM_FIT, db.uri, str(_art(db)), str(tiny), TEMPLATE]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode != 0 and "terminated by SIGTERM" in done.stderr
    (run,) = db.metadata.list_runs("trainer", "prov")
    assert run.status == "interrupted" and "SIGTERM" in (run.error or "")
    assert run.info["steps"] == 3 and run.info["tokens"] > 0


def test_the_stores_accept_the_interrupted_status(store: MetadataStore) -> None:
    store.create_run("r", "trainer", "t", 0, {})
    store.update_run("r", status="interrupted", error="KeyboardInterrupt", info={"steps": 3})
    run = store.get_run("r")
    assert run.status == "interrupted" and run.info == {"steps": 3}


@pytest.mark.parametrize("kind", ["uri", "engine"])
def test_fit_with_a_uri_or_an_engine_for_db_says_to_connect(tiny: Path, db: Any, kind: str) -> None:
    wrong = db.uri if kind == "uri" else sa.create_engine(db.uri)
    with pytest.raises(
        ConfigError, match=r"fit\(db=\) needs a database opened with llmtrain\.connect\(\)"
    ):
        _fit(_trainer(tiny), wrong)
    assert db.show("trainer") == []
