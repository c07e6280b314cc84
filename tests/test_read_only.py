"""Reading never creates: no database file, no ``_llmtrain_*`` table, collection or index, no
artifact folder. Tables appear with the first write; a mistyped SQLite path is an error that
names it, for reads and for a fit, and leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import fill

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.errors import ComponentNotFoundError, DatabaseNotFoundError, StoreError
from llmtrain.testing import tiny_model
from llmtrain.uri import is_mongo_uri


def stored_names(uri: str) -> set[str]:
    """Every table or collection (with its indexes) in the database."""
    if is_mongo_uri(uri):
        from llmtrain.db.engines import mongo_database

        db = mongo_database(uri)
        names = set(db.list_collection_names())
        return names | {f"{c}.{i}" for c in names for i in db[c].index_information()}
    from llmtrain.db.engines import sql_engine

    return set(sa.inspect(sql_engine(uri)).get_table_names())


def test_reading_an_empty_database_creates_nothing(any_uri: str, tmp_path: Path) -> None:
    db = lt.connect(any_uri, artifacts=tmp_path / "artifacts")
    assert db.show() == [] and db.show("trainer") == [] and db.show("model", "m") == []
    with pytest.raises(ComponentNotFoundError, match="no trainer 't'"):
        db.load("trainer", "t")
    meta = db.metadata
    assert meta.list_runs() == [] and meta.get_metrics("r") == []
    assert meta.list_checkpoints("r") == []
    with pytest.raises(StoreError, match="no run 'r'"):
        meta.get_run("r")
    with pytest.raises(StoreError, match="no run 'r'"):
        meta.update_run("r", status="failed", error="x")
    assert db.remove("trainer", "t") == 0
    meta.remove_checkpoint("r", 1)
    meta.remove_run("r")
    assert not db.artifacts.exists("sha256:" + "0" * 64)
    assert stored_names(any_uri) == set()
    assert not (tmp_path / "artifacts").exists()

    assert meta.add_component("trainer", "t", {}) == 0  # the first write creates them
    assert {n for n in stored_names(any_uri) if "." not in n} == {
        "_llmtrain_components",
        "_llmtrain_runs",
        "_llmtrain_metrics",
        "_llmtrain_checkpoints",
    }
    db.close()


def test_reading_leaves_user_tables_alone(any_uri: str) -> None:
    fill(any_uri, "docs", [{"id": 1, "text": "a"}])
    before = stored_names(any_uri)
    assert lt.connect(any_uri).show() == []
    assert stored_names(any_uri) == before


def test_a_missing_sqlite_file_is_an_error_naming_it(tmp_path: Path) -> None:
    typo = tmp_path / "typo.db"
    db = lt.connect(f"sqlite:///{typo}")
    with pytest.raises(DatabaseNotFoundError, match=f"no SQLite database at {typo}"):
        db.show()
    with pytest.raises(DatabaseNotFoundError, match="typo.db"):
        db.load("model", "m")
    with pytest.raises(DatabaseNotFoundError, match="typo.db"):
        db.metadata.list_runs()
    assert list(tmp_path.iterdir()) == []


def test_show_on_a_missing_sqlite_file_exits_2_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "typo.db"
    assert main(["show", "--db", f"sqlite:///{typo}"]) == 2
    err = capsys.readouterr().err
    assert f"no SQLite database at {typo}" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_show_on_an_empty_server_database_creates_no_tables(
    sql_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", "--db", sql_uri]) == 0
    assert "nothing stored" in capsys.readouterr().out
    assert stored_names(sql_uri) == set()


def test_fit_on_a_mistyped_sqlite_path_fails_and_leaves_no_file(tmp_path: Path) -> None:
    tiny = tiny_model(tmp_path / "models" / "llama", hidden_size=32, num_layers=1, vocab_size=400)
    trainer = lt.LLMTrainer(
        "t", model=str(tiny), prompt_template="{X} {Y}", max_steps=1, progress_bar=False
    )
    typo = tmp_path / "data" / "typo.db"
    typo.parent.mkdir()
    db = lt.connect(f"sqlite:///{typo}", artifacts=tmp_path / "artifacts")
    with pytest.raises(DatabaseNotFoundError, match=str(typo)):
        trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"))
    assert list(typo.parent.iterdir()) == [] and not (tmp_path / "artifacts").exists()


def test_a_separate_metadata_file_is_created_by_its_first_write(tmp_path: Path) -> None:
    data = f"sqlite:///{tmp_path / 'data.db'}"
    fill(data, "docs", [{"id": 1, "text": "a"}])
    db = lt.connect(data, metadata_uri=f"sqlite:///{tmp_path / 'meta.db'}")
    assert db.show() == [] and db.metadata.list_runs() == [] and db.remove("note", "n") == 0
    with pytest.raises(ComponentNotFoundError):
        db.load("note", "n")
    assert not (tmp_path / "meta.db").exists()
    assert db.metadata.add_component("note", "n", {}) == 0
    assert (tmp_path / "meta.db").is_file() and db.show() == [
        {"type_id": "note", "identifier": "n"}
    ]
