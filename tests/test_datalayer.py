"""connect() and components: add/load/show/remove through the Datalayer, on every backend."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ConfigDict

import llmtrain as lt
from llmtrain.datalayer import default_artifact_dir
from llmtrain.errors import ComponentNotFoundError, ConfigError, StoreError
from llmtrain.stores.artifacts import LocalArtifactStore, open_artifacts
from llmtrain.stores.components import register_component
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
    assert db.show() == [
        {"type_id": "note", "identifier": "greeting"},
        {"type_id": "note", "identifier": "other"},
    ]
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

    from llmtrain.db.engines import sql_engine

    db = lt.connect(sqlite_uri)
    db.add(Note("n", "t"))
    with sql_engine(sqlite_uri).begin() as conn:
        conn.execute(
            sa.text("UPDATE _llmtrain_components SET payload = :p"),
            {"p": '{"identifier": "n", "text": "t", "evil": {"py/object": "os.system"}}'},
        )
    with pytest.raises(StoreError, match="not a valid Note"):
        db.load("note", "n")


def test_uris_are_redacted() -> None:
    assert redact_uri("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    for password in ("p/w", "p#w", "p?w", "p:w"):  # read to the "@", as the drivers read it
        redacted = redact_uri(f"postgresql://u:{password}@h:5432/db?sslmode=require")
        assert redacted == "postgresql://u:***@h:5432/db?sslmode=require"
    assert redact_uri("sqlite:///x.db") == "sqlite:///x.db"
    assert default_artifact_dir("postgresql://u:p/w@h/db").name == "h-db"
    assert (
        redact_uri("mongodb://h/db?authSource=admin&password=pw")
        == "mongodb://h/db?authSource=admin&password=***"
    )
    db = lt.connect("postgresql://u:s3cret@127.0.0.1/db")
    assert "s3cret" not in repr(db) and "s3cret" not in db.uri


def test_connect_rejects_a_non_uri() -> None:
    with pytest.raises(ConfigError, match="database URI"):
        lt.connect("data.db")


def test_default_artifact_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_artifact_dir(f"sqlite:///{tmp_path}/data.db") == tmp_path / "data.db.artifacts"
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    assert (
        default_artifact_dir("postgresql://u:p@db.example/prod")
        == tmp_path / "home" / "artifacts" / "db.example-prod"
    )


def test_adding_an_unchanged_component_keeps_the_newest_version(
    any_uri: str, tmp_path: Path
) -> None:
    db = lt.connect(any_uri, artifacts=tmp_path / "a")
    note = Note("n", "same")
    assert db.add(note) == 0
    assert db.add(Note("n", "same")) == 0 and note.version == 0
    assert db.add(Note("n", "changed")) == 1
    assert db.add(Note("n", "same")) == 2  # equal to an older version, not the newest
    assert db.show("note", "n") == [0, 1, 2]


def _trainer_with_history(db: Any) -> dict[str, Any]:
    """The records a fit leaves: trainer v0 and v1, a run of each with a checkpoint, and the
    model versions they produced (v1 shares its adapter with v0)."""
    meta, art = db.metadata, db.artifacts
    ids = {
        name: art.put_bytes(name.encode())
        for name in ("ckpt0", "ckpt1", "adapter0", "adapter1", "other")
    }
    for version in (0, 1):
        meta.add_component("trainer", "t", {"recipe": version})
        meta.create_run(f"run{version}", "trainer", "t", version, {})
        meta.log_metrics(f"run{version}", 1, {"loss": 1.0})
        meta.add_checkpoint(f"run{version}", 1, ids[f"ckpt{version}"], {})
    meta.add_component("model", "t", {"adapter": ids["adapter0"], "trainer_version": 0})
    meta.add_component(
        "model", "t", {"adapter": ids["adapter0"], "trainer_version": 0, "history": []}
    )
    meta.add_component("model", "t", {"adapter": ids["adapter1"], "trainer_version": 1})
    meta.add_component("model", "u", {"adapter": ids["other"], "trainer_version": 0})
    return ids


def test_removing_a_trainer_with_runs_or_models_is_refused_naming_them(
    any_uri: str, tmp_path: Path
) -> None:
    db = lt.connect(any_uri, artifacts=tmp_path / "a")
    _trainer_with_history(db)
    with pytest.raises(
        StoreError,
        match=r"trainer 't' still has 2 run\(s\) \(run0, run1\) and "
        r"model 't' version\(s\) 0, 1, 2.*force=True",
    ):
        db.remove("trainer", "t")
    with pytest.raises(StoreError, match=r"1 run\(s\) \(run1\) and model 't' version\(s\) 2"):
        db.remove("trainer", "t", version=1)
    assert db.show("trainer", "t") == [0, 1] and len(db.metadata.list_runs()) == 2


def test_force_removes_a_trainer_with_its_runs_checkpoints_and_models(
    any_uri: str, tmp_path: Path
) -> None:
    db = lt.connect(any_uri, artifacts=tmp_path / "a")
    ids = _trainer_with_history(db)
    assert db.remove("trainer", "t", version=1, force=True) == 1
    assert db.show("trainer", "t") == [0] and db.show("model", "t") == [0, 1]
    assert [r.run_id for r in db.metadata.list_runs()] == ["run0"]
    assert db.metadata.get_metrics("run1") == [] and db.metadata.list_checkpoints("run1") == []
    assert not db.artifacts.exists(ids["ckpt1"]) and not db.artifacts.exists(ids["adapter1"])
    assert db.artifacts.exists(ids["ckpt0"]) and db.artifacts.exists(ids["adapter0"])

    assert db.remove("trainer", "t", force=True) == 1
    assert db.show("trainer") == [] and db.show("model") == ["u"]
    assert db.metadata.list_runs() == []
    assert not any(db.artifacts.exists(ids[k]) for k in ("ckpt0", "adapter0"))
    assert db.artifacts.exists(ids["other"])  # another trainer's model keeps its artifact


def test_removing_a_model_or_a_trainer_without_history_needs_no_force(
    sqlite_uri: str, tmp_path: Path
) -> None:
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "a")
    db.metadata.add_component("trainer", "lonely", {})
    db.metadata.add_component("model", "m", {"adapter": None, "trainer_version": 0})
    assert db.remove("model", "m") == 1
    assert db.remove("trainer", "lonely") == 1


@pytest.mark.parametrize("spec", ["nosuch://bucket/prefix", "HTTPS://host/x"])
def test_artifacts_url_with_an_unknown_scheme_is_a_config_error(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    scheme = spec.split("://")[0]
    with pytest.raises(ConfigError, match=f"no artifact store handles {scheme}://"):
        lt.connect(f"sqlite:///{tmp_path / 'x.db'}", artifacts=spec)
    with pytest.raises(ConfigError, match=f"artifacts='{spec}'"):
        open_artifacts(spec)
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:"


def test_file_url_is_the_local_folder(tmp_path: Path) -> None:
    store = open_artifacts(f"file://{tmp_path / 'art'}")
    assert isinstance(store, LocalArtifactStore) and store.root == tmp_path / "art"


def test_a_failing_import_surfaces_instead_of_unknown_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in component module that cannot import (a missing dependency) raises that
    ImportError, not "unknown component type 'model'"."""
    import sys

    import llmtrain.stores.components as components

    monkeypatch.setattr(components, "_registry", {})
    monkeypatch.delitem(sys.modules, "llmtrain.training.model", raising=False)
    monkeypatch.setitem(sys.modules, "llmtrain.config.args", None)  # as if not installable
    with pytest.raises(ImportError, match="llmtrain.config.args"):
        components.component_class("model")


def test_an_unknown_component_type_lists_the_known_ones() -> None:
    from llmtrain.stores.components import component_class

    with pytest.raises(StoreError, match=r"unknown component type 'nope'; known: .*'model'"):
        component_class("nope")
