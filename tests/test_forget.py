"""Forget, trained_on and incremental fits cannot be fooled by how a source or a key is
spelled: sources resolve through the database's catalog, keys are typed by the key column,
a forget is validated before its one write, the version recorded for a row is the one read
for training, and an incremental fit checks its parent before recording anything."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fill
from hooks import KeyTrace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.db.engines import mongo_database, sql_engine
from llmtrain.db.keys import key_repr
from llmtrain.errors import ConfigError, DataError, QueryError
from llmtrain.provenance.lineage import FORGOTTEN, RunLineage
from llmtrain.testing import tiny_model
from llmtrain.training.callbacks import Callback

TEMPLATE = "Q: {X}\nA: {Y}"
OPTIONS: dict[str, Any] = {
    "num_train_epochs": 1,
    "batch_size": 4,
    "learning_rate": 1e-2,
    "lora_r": 4,
    "progress_bar": False,
}


def _row(i: int, version: int = 1) -> dict[str, Any]:
    return {"id": i, "q": f"question {i}", "a": f"answer {i % 5}", "v": version}


def _trainer(tiny: Path, name: str, **options: Any) -> lt.LLMTrainer:
    return lt.LLMTrainer(name, model=tiny, prompt_template=TEMPLATE, **{**OPTIONS, **options})


def _keys_trained(db: Any, name: str, version: int | None = None) -> set[Any]:
    return {row.key for row in db.lineage("model", name, version)}


def _records(db: Any) -> tuple[int, int, int]:
    """How much the stores hold: components, runs, forgotten records."""
    meta = db.metadata
    return len(meta.list_components()), len(meta.list_runs()), len(meta.list_components(FORGOTTEN))


def _spellings(uri: str) -> list[str]:
    """Names of the table ``docs`` the database itself accepts."""
    name = uri.rsplit("/", 1)[-1]
    if uri.startswith("sqlite"):
        return ["docs", "Docs", "main.docs", "MAIN.DOCS"]
    if uri.startswith("postgresql"):
        return ["docs", "DOCS", "public.docs", "Public.Docs"]
    if uri.startswith("mongo"):
        return ["docs", f"{name}.docs"]
    return ["docs", f"{name}.docs"]  # MariaDB: table names are case-sensitive on Linux


def test_every_spelling_of_a_source_and_key_finds_and_forgets_the_same_rows(
    any_uri: str, tiny: Path, tmp_path: Path
) -> None:
    fill(any_uri, "docs", [_row(i) for i in range(12)])
    db = lt.connect(any_uri, artifacts=tmp_path / "artifacts")
    mongo = any_uri.startswith("mongo")
    select = lt.Collection("docs") if mongo else lt.Table("docs")
    first = _trainer(tiny, "t").fit(X="q", Y="a", db=db, select=select)
    assert first is not None and 5 in _keys_trained(db, "t")
    (run,) = db.metadata.list_runs("trainer", "t")
    spellings = _spellings(any_uri)
    found_key = "_id" if mongo else "id"
    assert run.info["source"].endswith((".docs(id)", ".docs(_id)"))  # table and key column
    for spelling in spellings:
        for key in (5, "5", 5.0):
            found = db.trained_on(spelling, key)
            assert found.runs == [run.run_id] and found.keys == [5], (spelling, key)
            assert run.info["source"] == f"{found.source}({found_key})"
    assert not db.trained_on(spellings[0], 100)

    # refused before anything is written: an unknown table, keys of another type
    before = _records(db)
    with pytest.raises(QueryError, match="no (table|collection) 'nope'"):
        db.forget("nope", [5])
    for bad in (None, True, {"id": 8}, "x5", 6.5):
        with pytest.raises(ConfigError, match="is not a key of"):
            db.forget(spellings[1], [1, bad])
    with pytest.raises(ConfigError, match="non-empty list"):
        db.forget("docs", [])
    assert _records(db) == before

    # one spelling forgets, every other finds it forgotten; a later fit, through a Table, a
    # collection or raw SQL reading that table, leaves the row out and records so
    result = db.forget(spellings[-1], ["5"])
    assert result.runs == [run.run_id] and result.models == [("t", first.version)]
    assert _records(db) == (before[0] + 1, before[1], before[2] + 1)
    for spelling in spellings:
        assert db.trained_on(spelling, 5).forgotten == [5]
    again = lt.sql("SELECT id, q, a FROM docs", key="id") if not mongo else select
    model = _trainer(tiny, "u").fit(X="q", Y="a", db=db, select=again)
    assert model is not None
    assert 5 not in _keys_trained(db, "u") and len(_keys_trained(db, "u")) == 11
    (later,) = db.metadata.list_runs("trainer", "u")
    assert later.info["forgets"] == {run.info["source"]: {"keys": 1, "version": 0}}
    # forgetting it again writes nothing new
    assert db.forget(spellings[0], [5]).runs == [run.run_id]
    assert len(db.metadata.list_components(FORGOTTEN)) == before[2] + 1
    db.close()


def test_raw_sql_names_the_table_its_key_comes_from(sqlite_uri: str, tmp_path: Path) -> None:
    fill(sqlite_uri, "docs", [_row(i) for i in range(4)])
    fill(sqlite_uri, "tags", [{"id": i, "doc": i, "tag": "t"} for i in range(4)])
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "artifacts")
    joined = "SELECT d.id AS id, d.q, t.tag FROM docs d JOIN tags t ON t.doc = d.id"
    assert db.backend.resolve(lt.sql(joined, key="id")).name == "main.docs"
    assert db.backend.resolve(lt.sql("SELECT id, q FROM Docs", key="id")).name == "main.docs"
    ambiguous = "SELECT id, q FROM docs UNION SELECT id, tag FROM tags"
    with pytest.raises(QueryError, match="source="):
        db.backend.resolve(lt.sql(ambiguous, key="id"))
    assert db.backend.resolve(lt.sql(ambiguous, key="id", source="docs")).name == "main.docs"
    db.close()


def test_mongo_keys_are_typed_by_the_collection(tmp_path: Path) -> None:
    from bson import ObjectId

    uri = f"mongomock://localhost/lt_{uuid.uuid4().hex[:8]}"
    ids = [ObjectId() for _ in range(3)]
    mongo_database(uri)["docs"].insert_many([{"_id": i, "q": "x"} for i in ids])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    source = db.backend.resolve("docs")
    assert source.typed([str(ids[0]), ids[1]]) == [ids[0], ids[1]]
    with pytest.raises(ConfigError, match="ObjectId"):
        source.typed([5])
    with pytest.raises(QueryError, match="no collection 'Docs'"):  # MongoDB names fold nothing
        db.backend.resolve("Docs")


def test_incremental_checks_its_parent_and_refusals_record_nothing(
    tiny: Path, tmp_path: Path, capsys: Any
) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [_row(i) for i in range(8)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    parent = _trainer(tiny, "inc").fit(X="q", Y="a", db=db, select=lt.Table("docs"))
    assert parent is not None

    # nothing new: one line, the parent model back, nothing recorded (also through a replay)
    before = _records(db)
    capsys.readouterr()
    for fit in (
        lambda: _trainer(tiny, "inc").fit(
            X="q", Y="a", db=db, select=lt.Table("docs"), incremental=True
        ),
        lambda: db.load("trainer", "inc").fit(incremental=True),
    ):
        same = fit()
        assert same is not None and same.version == parent.version
        out = capsys.readouterr()
        assert "nothing new" in out.out and "anyway" not in out.out + out.err
    assert _records(db) == before

    # a parent of another adapter shape or base model: refused, naming both, nothing recorded
    with sql_engine(uri).begin() as conn:
        conn.execute(sa.text("INSERT INTO docs (id, q, a, v) VALUES (8, 'question 8', 'x', 1)"))
    with pytest.raises(ConfigError, match="r=4.*8"):
        _trainer(tiny, "inc", lora_r=8).fit(
            X="q", Y="a", db=db, select=lt.Table("docs"), incremental=True
        )
    other = tiny_model(tmp_path / "other-base")
    with pytest.raises(ConfigError, match="model_name_or_path"):
        lt.LLMTrainer("inc", model=other, prompt_template=TEMPLATE, **OPTIONS).fit(
            X="q", Y="a", db=db, select=lt.Table("docs"), incremental=True
        )
    assert _records(db) == before

    # a forgotten row in the parent's lineage: refused unless the override, which is recorded
    db.forget("docs", [3])
    before = _records(db)
    with pytest.raises(ConfigError, match="forgotten since.*int:3"):
        db.load("trainer", "inc").fit(incremental=True)
    assert _records(db) == before
    child = db.load("trainer", "inc").fit(incremental=True, allow_forgotten_parent=True)
    assert child is not None and child.version == parent.version + 1
    run = db.metadata.get_run(child.record.run_id)
    assert run.info["allow_forgotten_parent"] is True and run.info["incremental"]["new_rows"] == 1
    assert 3 in _keys_trained(db, "inc", child.version)  # its parent's rows are its lineage
    assert (
        main(["show", "model", "inc", "--db", uri, "--artifacts", str(tmp_path / "artifacts")]) == 0
    )
    out = capsys.readouterr().out
    shown = [ln.split() for ln in out.splitlines()]
    assert [ln[-1] for ln in shown if ln and ln[0] in ("0", "1")] == ["1", "1"]

    # every selected row forgotten: one DataError, nothing recorded
    db.forget("docs", list(range(9)))
    before = _records(db)
    with pytest.raises(DataError, match=r"selects 0 rows \(forgotten rows"):
        _trainer(tiny, "fresh").fit(X="q", Y="a", db=db, select=lt.Table("docs"))
    assert _records(db) == before
    db.close()


@pytest.mark.parametrize("versioned", [True, False])
def test_the_version_recorded_is_the_one_read_for_training(
    sql_uri: str, tiny: Path, tmp_path: Path, versioned: bool
) -> None:
    """Rows updated mid-fit: lineage names the version each row trained in, and the next
    incremental fit retrains exactly the rows whose trained version is no longer current
    (without a version column it sees new keys only, as the run records)."""
    fill(sql_uri, "docs", [_row(i) for i in range(16)])
    db = lt.connect(sql_uri, artifacts=tmp_path / "artifacts")
    options = {"version_column": "v"} if versioned else {}

    class UpdateAll(KeyTrace):
        def on_step(self, run: Any, keys: list[str]) -> None:
            super().on_step(run, keys)
            if run.step == 1:
                with sql_engine(sql_uri).begin() as conn:
                    conn.execute(sa.text("UPDATE docs SET a = 'new', v = 2"))

    trace = UpdateAll()
    _trainer(tiny, "ver", batch_size=2, cache_size=2, **options).fit(
        X="q", Y="a", db=db, select=lt.Table("docs"), callbacks=[trace]
    )
    (run,) = db.metadata.list_runs("trainer", "ver")
    versions = {}
    for key in range(16):
        (use,) = db.trained_on("docs", key).uses
        versions[key] = use.row_version
    if not versioned:
        assert set(versions.values()) == {None}
        old: set[int] = set()
    else:
        first_step = {int(k.split(":")[1]) for k in trace.steps[0]["keys"]}
        assert all(versions[k] == 1 for k in first_step)
        old = {k for k, v in versions.items() if v == 1}
        assert 0 < len(old) < 16 and versions.keys() - old == {
            k for k, v in versions.items() if v == 2
        }
    with sql_engine(sql_uri).begin() as conn:
        conn.execute(sa.text("INSERT INTO docs (id, q, a, v) VALUES (16, 'question 16', 'x', 2)"))
    child = db.load("trainer", "ver").fit(incremental=True)
    assert child is not None
    run = db.metadata.get_run(child.record.run_id)
    own = {c.key for c in RunLineage.of(db, run).rows()}  # the child's own run
    if versioned:
        assert run.info["incremental"]["detects"] == "changed rows"
        assert own == old | {16}  # rows trained in version 2 are current: not again
    else:
        assert run.info["incremental"]["detects"] == "new keys only"
        assert own == {16}
    db.close()


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["fit", "incremental", "forget", "insert", "update", "delete"]),
        st.integers(0, 15),
        st.sampled_from(["docs", "DOCS", "main.docs", "Main.Docs"]),
    ),
    min_size=3,
    max_size=6,
)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_no_model_fitted_after_a_forget_holds_the_row(tiny: Path, ops: list[Any]) -> None:
    """Random fits (plain, incremental), forgets under any spelling, inserts, updates and
    deletes: a model fitted after forget(key) never has the key in its lineage, and
    trained_on agrees with lineage."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        uri = f"sqlite:///{folder}/data.db"
        fill(uri, "docs", [_row(i) for i in range(8)])
        db = lt.connect(uri, artifacts=f"{folder}/artifacts")
        engine = sql_engine(uri)
        forgotten: set[int] = set()
        size, version = 8, 1
        for op, key, spelling in ops:
            if op == "forget":
                db.forget(spelling, [str(key)])
                forgotten.add(key)
            elif op == "insert":
                with engine.begin() as conn:
                    conn.execute(
                        sa.text("INSERT INTO docs (id, q, a, v) VALUES (:id, :q, :a, :v)"),
                        _row(size),
                    )
                size += 1
            elif op in ("update", "delete"):
                version += 1
                statement = (
                    "UPDATE docs SET a = 'changed', v = :v WHERE id = :k"
                    if op == "update"
                    else "DELETE FROM docs WHERE id = :k AND :v > 0"
                )
                with engine.begin() as conn:
                    conn.execute(sa.text(statement), {"k": key, "v": version})
            else:
                trainer = _trainer(tiny, "prop", version_column="v")
                runs = len(db.metadata.list_runs())
                try:
                    model = trainer.fit(
                        X="q",
                        Y="a",
                        db=db,
                        select=lt.Table("docs"),
                        incremental=op == "incremental",
                    )
                except ConfigError as exc:  # a parent that trained a forgotten row
                    assert "forgotten since" in str(exc) and op == "incremental"
                    continue
                except DataError as exc:  # every row forgotten or deleted
                    assert "nothing to train on" in str(exc) or "0 rows" in str(exc)
                    continue
                if len(db.metadata.list_runs()) == runs:
                    continue  # nothing new: the parent model came back
                assert model is not None
                lineage = list(db.lineage("model", "prop", model.version))
                assert not {row.key for row in lineage} & forgotten
                run_id = model.record.run_id
                own = {row.key for row in lineage if row.run_id == run_id}
                for k in range(size):  # its own uses; runs also lists inherited ones
                    found = db.trained_on(spelling, k)
                    assert (run_id in {u.run_id for u in found.uses}) == (k in own), k
                    assert (k in {row.key for row in lineage}) <= (run_id in found.runs)
        engine.dispose()
        db.close()


def test_a_forget_names_the_key_column_its_keys_belong_to(
    sqlite_uri: str, tiny: Path, tmp_path: Path
) -> None:
    """Rows keyed by another column of the same table are other keys: forgetting id 5 leaves
    the row whose ext is 5 alone, and the other way round; forgotten rows are not held out
    for evaluation either."""
    import numpy as np

    rows = [{**_row(i), "ext": 100 - i} for i in range(12)]
    fill(sqlite_uri, "docs", rows)
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "artifacts")
    by_ext = lt.Table("docs", key="ext")
    _trainer(tiny, "ext").fit(X="q", Y="a", db=db, select=by_ext)
    (ext_run,) = db.metadata.list_runs("trainer", "ext")
    # id 5 is the row whose ext is 95: the database says which row the run keyed by ext read
    assert db.trained_on("docs", 5).runs == [ext_run.run_id]
    assert db.trained_on("docs", 95).runs == []  # no row has id 95
    result = db.forget(by_ext, [np.int64(95)])  # numpy integers type as the column's
    assert result.runs == [ext_run.run_id] and result.source == "main.docs"
    assert db.trained_on(by_ext, 95).forgotten == [95] and db.trained_on("docs", 95).forgotten == []
    held = _trainer(tiny, "held", eval_fraction=0.5).fit(X="q", Y="a", db=db, select=by_ext)
    assert held is not None
    (run,) = db.metadata.list_runs("trainer", "held")
    from llmtrain.data.snapshot import RunSnapshot

    snapshot = RunSnapshot.from_record(run.info["snapshot"])
    assert snapshot.held is not None
    views = [snapshot.train, snapshot.held]
    every = {k for v in views for k in v.keys(db.artifacts, 0, v.count)}
    assert 95 not in every and len(every) == 11
    assert db.backend.resolve("docs").typed([np.str_("7")]) == [7]
    db.close()


def test_raw_sql_names_the_table_postgresql_reads_unquoted_names_folded(tmp_path: Path) -> None:
    """``FROM Docs`` reads docs on PostgreSQL, whatever table "Docs" exists beside it: the run
    records the table it read, so trained_on and forget on docs find it."""
    from conftest import fresh_database

    databases = fresh_database("postgresql", tmp_path)
    uri = next(databases)
    fill(uri, "docs", [_row(i) for i in range(4)])
    fill(uri, "Docs", [_row(i) for i in range(100, 104)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    for text, table in [
        ("SELECT id, q, a FROM Docs", "public.docs"),
        ("SELECT id, q, a FROM DOCS", "public.docs"),
        ("SELECT ID, q, a FROM Public.Docs", "public.docs"),
        ('SELECT id, q, a FROM "Docs"', "public.Docs"),
        ('SELECT d.id, d.q FROM "Docs" AS d JOIN docs ON docs.id = d.id', "public.Docs"),
    ]:
        assert db.backend.resolve(lt.sql(text, key="id")).name == table, text
    # a name typed as in SQL is read as the server reads it: forget("Docs") forgets docs' row
    assert db.forget("Docs", [1]).source == "public.docs"
    pages = db.backend.key_pages(lt.sql("SELECT id, q FROM Docs", key="id"), None, 10)
    assert [int(k) for page in pages for k in page.keys] == [0, 2, 3]
    db.close()
    next(databases, None)


def test_raw_sql_traces_only_bare_columns_and_aliases_first(
    sqlite_uri: str, tmp_path: Path
) -> None:
    fill(sqlite_uri, "a", [{"id": 1, "q": "x"}])
    fill(sqlite_uri, "b", [{"id": 2, "q": "y"}])
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "artifacts")
    swapped = "SELECT a.id AS id, c.q FROM a AS c JOIN b AS a ON a.id = c.id"
    assert db.backend.resolve(lt.sql(swapped, key="id")).name == "main.b"  # alias a is b
    for computed in ("SELECT CAST(id AS TEXT) AS id, q FROM a", "SELECT id + 1 AS id FROM a"):
        with pytest.raises(QueryError, match="source="):
            db.backend.resolve(lt.sql(computed, key="id"))
    db.close()


def test_a_collection_of_mixed_id_types_takes_keys_as_given(tmp_path: Path) -> None:
    from bson import ObjectId

    uri = f"mongomock://localhost/lt_{uuid.uuid4().hex[:8]}"
    mongo_database(uri)["docs"].insert_many([{"_id": 5}, {"_id": "k"}, {"_id": ObjectId()}])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    assert db.backend.resolve("docs").typed(["5", 5]) == ["5", 5]  # no guess between them


def test_an_untyped_sqlite_key_column_types_keys_as_its_rows_hold_them(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "loose.db"
    with sqlite3.connect(path) as conn:  # no declared types, as quick scripts make tables
        conn.execute("CREATE TABLE docs (id PRIMARY KEY, q)")
        conn.executemany("INSERT INTO docs VALUES (?, ?)", [(i, f"q{i}") for i in range(3)])
        conn.execute("CREATE TABLE mixed (id PRIMARY KEY, q)")
        conn.executemany("INSERT INTO mixed VALUES (?, ?)", [(1, "a"), ("k", "b")])
    db = lt.connect(f"sqlite:///{path}", artifacts=tmp_path / "artifacts")
    assert db.backend.resolve("docs").typed(["2"]) == [2]  # the CLI's text, as the rows hold it
    assert db.backend.resolve("mixed").typed(["1"]) == ["1"]  # mixed: taken as given
    db.close()


def test_forgotten_rows_of_an_eval_selection_are_not_evaluated_on(
    sqlite_uri: str, tiny: Path, tmp_path: Path
) -> None:
    from llmtrain.data import RunSnapshot

    fill(sqlite_uri, "docs", [_row(i) for i in range(16)])
    fill(sqlite_uri, "evals", [_row(i) for i in range(100, 110)])
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "artifacts")
    db.forget("evals", [103, 107])
    sizes: list[int] = []

    class EvalRows(Callback):
        def on_step(self, run: Any, keys: list[str]) -> None:
            if run._eval_data is not None:  # built at the first evaluation
                sizes.append(len(run._eval_data))

    _trainer(tiny, "evaluated", eval_steps=1).fit(
        X="q",
        Y="a",
        db=db,
        select=lt.Table("docs"),
        eval_select=lt.Table("evals"),
        callbacks=[EvalRows()],
    )
    assert sizes and set(sizes) == {8}  # what the evaluations read
    (run,) = db.metadata.list_runs("trainer", "evaluated")
    held = RunSnapshot.from_record(run.info["eval_snapshot"])  # taken with the run's
    assert held.train.count == 8  # the two forgotten rows are left out
    assert any("eval_loss" in m.values for m in db.metadata.get_metrics(run.run_id))


def test_a_run_whose_key_snapshot_is_gone_is_reported_unknown_not_clean(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose snapshot chunks were deleted from the artifact store cannot say whether it
    trained on a row: trained_on, forget and the CLI say so, naming the run."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [_row(i) for i in range(8)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    _trainer(tiny, "gone").fit(X="q", Y="a", db=db, select=lt.Table("docs"))
    (run,) = db.metadata.list_runs("trainer", "gone")
    assert db.trained_on("docs", 3).runs == [run.run_id]
    for chunk in RunLineage.of(db, run).view.chunks:
        db.artifacts.delete(chunk)
    found = db.trained_on("docs", 3)
    assert found.underivable == [run.run_id] and not found
    assert (
        main(["trained-on", "docs", "3", "--db", uri, "--artifacts", str(tmp_path / "artifacts")])
        == 0
    )
    assert f"unknown (runs without a key snapshot): {run.run_id}" in capsys.readouterr().out
    with caplog.at_level("WARNING", logger="llmtrain"):
        db.forget("docs", [3])
    assert f"run {run.run_id}: no readable key snapshot" in caplog.text


class _StepKeys(Callback):
    """The keys each step trained, and a change to the table after some steps."""

    def __init__(self, changes: dict[int, str], engine: sa.Engine) -> None:
        self.keys: dict[int, list[str]] = {}
        self.changes, self.engine = changes, engine

    def on_step(self, run: Any, keys: list[Any]) -> None:
        self.keys[run.step] = sorted(keys)
        if statement := self.changes.get(run.step):
            with self.engine.begin() as conn:
                conn.execute(sa.text(statement))


def test_a_row_skipped_in_one_epoch_and_trained_in_a_later_one_is_in_its_lineage(
    tiny: Path, tmp_path: Path
) -> None:
    """A bad row fixed and a deleted row re-inserted during the run train in the next epoch:
    lineage, trained_on and forget say so, step for step, as the loop trained them."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [{**_row(i), "a": None if i == 6 else f"answer {i}"} for i in range(10)])
    changes = {
        1: "DELETE FROM docs WHERE id = 8",
        3: "UPDATE docs SET a = 'fixed' WHERE id = 6",
        5: "INSERT INTO docs (id, q, a, v) VALUES (8, 'question 8', 'answer 8', 1)",
    }
    steps = _StepKeys(changes, sql_engine(uri))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    options = {"num_train_epochs": 2, "batch_size": 2, "shuffle": False, "cache_size": 2}
    trainer = _trainer(tiny, "healed", on_bad_row="skip", **options)
    trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"), callbacks=[steps])
    lineage: dict[int, list[str]] = {}
    for row in db.lineage("model", "healed"):
        lineage.setdefault(row.step, []).append(key_repr(row.key))
    assert {s: sorted(k) for s, k in lineage.items()} == {s: k for s, k in steps.keys.items() if k}
    trained = [k for step in sorted(steps.keys) for k in steps.keys[step]]
    assert trained.count("int:6") == 1 and trained.count("int:8") == 1  # in the second epoch
    assert [u.epoch for u in db.trained_on("docs", 6).uses] == [1]
    assert [u.epoch for u in db.trained_on("docs", 8).uses] == [1]
    assert db.forget("docs", [6, 8]).models == [("healed", 0)]


def test_each_use_of_a_row_reports_the_version_that_epoch_read(tiny: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [_row(i, version=0) for i in range(10)])
    changes = {
        1: "UPDATE docs SET a = 'one', v = 1 WHERE id = 9",  # read at step 5
        6: "UPDATE docs SET a = 'two', v = 2 WHERE id = 9",  # read at step 10
    }
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    options = {"num_train_epochs": 2, "batch_size": 2, "shuffle": False, "cache_size": 2}
    trainer = _trainer(tiny, "versions", version_column="v", **options)
    trainer.fit(
        X="q",
        Y="a",
        db=db,
        select=lt.Table("docs"),
        callbacks=[_StepKeys(changes, sql_engine(uri))],
    )
    assert [(u.step, u.row_version) for u in db.trained_on("docs", 9).uses] == [(5, 1), (10, 2)]


def test_a_table_without_a_primary_key_is_named_with_how_to_give_its_key(tmp_path: Path) -> None:
    import sqlite3

    with sqlite3.connect(tmp_path / "data.db") as conn:
        conn.execute("CREATE TABLE nokey (a TEXT, b TEXT)")
        conn.execute("INSERT INTO nokey VALUES ('x', 'y')")
    db = lt.connect(f"sqlite:///{tmp_path / 'data.db'}", artifacts=tmp_path / "artifacts")
    message = r"main.nokey has no single-column primary key: .*lt.Table\('nokey', key=...\)"
    for call in (lambda: db.trained_on("nokey", "x"), lambda: db.forget("nokey", ["x"])):
        with pytest.raises(QueryError, match=message):
            call()
    assert db.trained_on(lt.Table("nokey", key="a"), "x").uses == []
    db.close()


class _Seen(Callback):
    """The keys each step trained."""

    def __init__(self) -> None:
        self.keys: dict[int, list[Any]] = {}

    def on_step(self, run: Any, keys: list[Any]) -> None:
        self.keys[run.step] = list(keys)


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, run: Any, keys: list[Any]) -> None:
        if run.step == self.step:
            raise KeyboardInterrupt


@pytest.mark.parametrize("mixed", [False, True])
def test_a_resumed_run_leaves_out_rows_forgotten_after_it_started(
    tiny: Path, tmp_path: Path, mixed: bool
) -> None:
    """The database leaves forgotten rows out of every read, a resumed run's windows too: rows
    forgotten after a run started and before it trained them are never trained, and its
    lineage says so."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [_row(i) for i in range(10)])
    fill(uri, "more", [_row(i) for i in range(6)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    select = lt.mix(lt.Table("more"), lt.Table("docs")) if mixed else lt.Table("docs")
    options = {"batch_size": 2, "shuffle": False, "save_steps": 2}
    fields = {"X": "q", "Y": "a", "db": db, "select": select}
    with pytest.raises(KeyboardInterrupt):
        _trainer(tiny, "paused", **options).fit(**fields, callbacks=[_StopAt(3)])
    (run,) = db.metadata.list_runs("trainer", "paused")
    gone = db.forget("docs", [8, 9])  # not trained yet by the interrupted run: it trains none
    assert not gone.runs and run.status == "interrupted"
    seen = _Seen()
    _trainer(tiny, "paused", **options).fit(**fields, resume=True, callbacks=[seen])
    assert db.metadata.list_runs("trainer", "paused")[0].status == "completed"
    later = {k for keys in seen.keys.values() for k in keys}  # key_reprs
    docs = [key_repr({"part": 1, "key": k}) if mixed else key_repr(k) for k in range(10)]
    assert set(docs[:8]) & later and not set(docs[8:]) & later
    keys = [row.key for row in db.lineage("model", "paused")]
    trained = {k["key"] for k in keys if k["part"] == 1} if mixed else set(keys)
    assert trained and not {8, 9} & trained
    assert not db.trained_on("docs", 8) and db.trained_on("docs", 0).runs == [run.run_id]
