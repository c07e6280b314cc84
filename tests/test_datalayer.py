"""connect() and components: add/load/show/remove through the Datalayer, on every backend."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ConfigDict

import llmtrain as lt
from llmtrain.components import register_component
from llmtrain.datalayer import default_artifact_dir
from llmtrain.errors import ComponentNotFoundError, ConfigError, StoreError
from llmtrain.uri import redact_uri


class _NoteFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    identifier: str
    text: str


@register_component
class Note:
    """A minimal component, as a user could write one."""

    type_id: ClassVar[str] = "note"

    def __init__(self, identifier: str, text: str) -> None:
        self.fields = _NoteFields(identifier=identifier, text=text)

    @property
    def identifier(self) -> str:
        return self.fields.identifier

    def to_dict(self) -> dict[str, Any]:
        return self.fields.model_dump()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Note:
        fields = _NoteFields.model_validate(data)
        return cls(fields.identifier, fields.text)


def test_add_load_show_remove(any_uri: str, tmp_path: Path) -> None:
    db = lt.connect(any_uri, artifacts=tmp_path / "a")
    assert db.add(Note("greeting", "hello")) == 0
    assert db.add(Note("greeting", "hello again")) == 1
    assert db.add(Note("other", "x")) == 0
    assert db.load("note", "greeting").fields.text == "hello again"
    loaded = db.load("note", "greeting", version=0)
    assert loaded.fields.text == "hello" and loaded.version == 0
    assert db.show() == [{"type_id": "note", "identifier": "greeting"},
                         {"type_id": "note", "identifier": "other"}]
    assert db.show("note") == ["greeting", "other"]
    assert db.show("note", "greeting") == [0, 1]
    assert db.remove("note", "greeting", version=1) == 1
    assert db.load("note", "greeting").version == 0
    assert db.remove("note", "greeting") == 1
    with pytest.raises(ComponentNotFoundError, match="greeting"):
        db.load("note", "greeting")


def test_datalayer_pickles_without_connections(sqlite_uri: str) -> None:
    db = lt.connect(sqlite_uri)
    db.add(Note("n", "t"))
    clone = pickle.loads(pickle.dumps(db))
    assert clone.load("note", "n").fields.text == "t"


@pytest.mark.parametrize("identifier", ["../etc", "a/b", "", ".hidden", "x" * 200, "a\x00b"])
def test_identifiers_are_validated(sqlite_uri: str, identifier: str) -> None:
    db = lt.connect(sqlite_uri)
    with pytest.raises(ConfigError, match="identifier"):
        db.add(Note(identifier, "t"))


def test_tampered_record_loads_as_an_error(sqlite_uri: str) -> None:
    import sqlalchemy as sa

    from llmtrain.backends.engines import sql_engine

    db = lt.connect(sqlite_uri)
    db.add(Note("n", "t"))
    with sql_engine(sqlite_uri).begin() as conn:
        conn.execute(sa.text("UPDATE _llmtrain_components SET payload = :p"),
                     {"p": '{"identifier": "n", "text": "t", "evil": {"py/object": "os.system"}}'})
    with pytest.raises(StoreError, match="not a valid Note"):
        db.load("note", "n")


def test_uris_are_redacted() -> None:
    assert redact_uri("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_uri("mongodb://h/db?authSource=admin&password=pw") == \
        "mongodb://h/db?authSource=admin&password=***"
    db = lt.connect("postgresql://u:s3cret@127.0.0.1/db")
    assert "s3cret" not in repr(db) and "s3cret" not in db.uri


def test_connect_rejects_a_non_uri() -> None:
    with pytest.raises(ConfigError, match="database URI"):
        lt.connect("data.db")


def test_default_artifact_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_artifact_dir(f"sqlite:///{tmp_path}/data.db") == tmp_path / "data.db.artifacts"
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    assert default_artifact_dir("postgresql://u:p@db.example/prod") == \
        tmp_path / "home" / "artifacts" / "db.example-prod"
