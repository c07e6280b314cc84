"""Metadata and artifacts edited behind llmtrain's back.

Promises: a stored component record edited (straight in the SQL table or the Mongo
collection) to hold a pickle, bytes, or JSON of unknown shape or type makes ``db.load`` raise
a ``StoreError``/``ConfigError``, and never runs code. Weights load only through safetensors
and ``torch.load(weights_only=True)``: a checkpoint whose ``optimizer.pt`` (or any other file)
was swapped for a malicious pickle, with a manifest that matches, fails to resume without
running code; so does a model whose adapter folder was swapped for a pickled one.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from conftest import fill

import llmtrain as lt
from llmtrain.db.engines import mongo_database, sql_engine
from llmtrain.errors import CheckpointError, ConfigError, StoreError
from llmtrain.training import run as run_module

from .helpers import doc_rows, trainer


class Plant:
    """Unpickling this creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def live_pickle(marker: Path, protocol: int = pickle.DEFAULT_PROTOCOL) -> bytes:
    """A payload that really runs code when unpickled (checked, then the marker removed)."""
    payload = pickle.dumps(Plant(marker), protocol=protocol)
    pickle.loads(payload)  # noqa: S301 - proving the payload is live
    assert marker.exists()
    marker.unlink()
    return payload


def live_torch_pickle(marker: Path, path: Path) -> None:
    """A ``torch.save`` file that runs code under ``torch.load(weights_only=False)``."""
    staging = path.with_name(path.name + ".pt")  # torch.load reads *.safetensors otherwise
    torch.save(Plant(marker), staging)
    torch.load(staging, weights_only=False)  # noqa: S614 - proving the payload is live
    assert marker.exists()
    marker.unlink()
    staging.rename(path)


# -- component records -------------------------------------------------------------------------
def _set_record(uri: str, **fields: Any) -> None:
    if uri.startswith("mongo"):
        mongo_database(uri)["_llmtrain_components"].update_many({}, {"$set": fields})
        return
    with sql_engine(uri).begin() as conn:
        table = sa.table("_llmtrain_components", *[sa.column(k) for k in fields])
        conn.execute(table.update().values(**fields))


def _tamperings(uri: str, marker: Path) -> dict[str, dict[str, Any]]:
    binary, text = live_pickle(marker), live_pickle(marker, protocol=0).decode("ascii")
    tamperings: dict[str, dict[str, Any]] = {
        "pickle as text": {"payload": text},  # protocol 0 is printable ASCII
        "JSON list": {"payload": json.dumps([1, 2, 3])},
        "JSON of unknown shape": {
            "payload": json.dumps({"py/reduce": [{"py/function": "builtins.exec"}, "import os"]})
        },
        "trainer with a code-like field": {
            "payload": json.dumps(
                {
                    "identifier": "t",
                    "model_args": {"model_name_or_path": "m"},
                    "lora_args": {},
                    "training_args": {},
                    "data_args": {},
                    "prompt_template": "{X}{Y}",
                    "__reduce__": "builtins.exec",
                }
            )
        },
        "unknown component type": {"type_id": "os.system"},
    }
    if uri.startswith(("sqlite", "mongo", "mysql")):  # PostgreSQL TEXT cannot hold NUL
        # a BLOB in SQLite's TEXT column, BSON Binary in Mongo, raw bytes in LONGTEXT
        tamperings["pickle bytes"] = {
            "payload": binary if not uri.startswith("mysql") else binary.decode("latin-1")
        }
    if uri.startswith("mongo"):
        tamperings["payload of another BSON type"] = {"payload": {"$numberLong": "1"}}
        tamperings["version of another type"] = {"version": {"a": 1}}
    return tamperings


RECORD_LEVEL = {
    "pickle bytes",
    "pickle as text",
    "JSON list",
    "payload of another BSON type",
    "version of another type",
}


def test_a_tampered_component_record_is_a_store_error_and_never_runs_code(
    uri_of: str, tiny: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    for what, fields in _tamperings(uri_of, marker).items():
        db = lt.connect(uri_of, artifacts=tmp_path / "artifacts")
        db.metadata.remove_component("trainer", "t")
        db.add(lt.LLMTrainer("t", model=str(tiny), prompt_template="{X}{Y}"))
        _set_record(uri_of, **fields)
        with pytest.raises((StoreError, ConfigError)) as info:
            db.load("trainer", "t") if "type" not in what else db.load("os.system", "t")
        assert not marker.exists(), f"{what}: the payload ran"
        assert "pwned" not in str(info.value)
        if what in RECORD_LEVEL:  # not even a component record: listing refuses it too
            with pytest.raises(StoreError, match="edited outside llmtrain"):
                db.show("trainer", "t")
        db.close()
        _set_record(uri_of, type_id="trainer")  # so that remove_component finds it again
    assert not marker.exists()


# -- checkpoint and model artifacts ----------------------------------------------------------
@pytest.fixture(scope="module")
def crashed(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A run that crashed after its checkpoint at step 2 (of 4)."""
    root = tmp_path_factory.mktemp("tamper")
    uri = f"sqlite:///{root / 'data.db'}"
    fill(uri, "docs", doc_rows(16))
    db = lt.connect(uri, artifacts=root / "artifacts")
    save = run_module.FitRun.save_checkpoint

    def crash(self: Any) -> Any:
        save(self)
        raise KeyboardInterrupt("crash after the first checkpoint")

    mp = pytest.MonkeyPatch()
    mp.setattr(run_module.FitRun, "save_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer(tiny, "victim", max_steps=4, save_steps=2).fit(
            X="instruction", Y="output", db=db, select=lt.Table("docs")
        )
    mp.undo()
    (run,) = db.metadata.list_runs("trainer", "victim")
    return db, root, run.run_id


def _swap_in(db: Any, root: Path, artifact_id: str, name: str, make: Any) -> str:
    """A copy of the checkpoint folder with ``name`` replaced by ``make(path)`` and the
    manifest rewritten to match, stored as a new (complete, consistent) artifact."""
    folder = root / f"swap-{name}-{hashlib.sha1(artifact_id.encode()).hexdigest()[:6]}"
    shutil.rmtree(folder, ignore_errors=True)
    db.artifacts.get_dir(artifact_id, folder)
    (folder / name).unlink()
    make(folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return db.artifacts.put_dir(folder)


@pytest.mark.parametrize(
    "name", ["optimizer.pt", "scheduler.pt", "rng_rank0.pt", "weights.safetensors"]
)
def test_a_checkpoint_file_swapped_for_a_malicious_pickle_fails_to_resume_without_running_it(
    crashed: Any, tiny: Path, name: str
) -> None:
    db, root, run_id = crashed
    marker = root / f"pwned-{name}"
    (record,) = db.metadata.list_checkpoints(run_id)
    evil = _swap_in(
        db, root, record.artifact_id, name, lambda path: live_torch_pickle(marker, path)
    )
    engine = sql_engine(db.secret_uri())
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE _llmtrain_checkpoints SET artifact_id = :a WHERE run_id = :r"),
            {"a": evil, "r": run_id},
        )
    try:
        with pytest.raises(CheckpointError, match=name):
            trainer(tiny, "victim", max_steps=4, save_steps=2).fit(
                X="instruction", Y="output", db=db, select=lt.Table("docs"), resume=True
            )
        assert not marker.exists(), "the pickle ran"
        (run,) = db.metadata.list_runs("trainer", "victim")
        assert run.status == "interrupted" and name in (run.error or "")
    finally:
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE _llmtrain_checkpoints SET artifact_id = :a WHERE run_id = :r"),
                {"a": record.artifact_id, "r": run_id},
            )


def test_a_checkpoint_file_changed_without_its_manifest_is_refused(
    crashed: Any, tmp_path: Path
) -> None:
    from llmtrain.training.checkpoint import verify

    db, _, run_id = crashed
    (record,) = db.metadata.list_checkpoints(run_id)
    folder = db.artifacts.get_dir(record.artifact_id, tmp_path / "ckpt")
    (folder / "optimizer.pt").write_bytes(b"not what the manifest says")
    with pytest.raises(CheckpointError, match="optimizer.pt is missing or corrupt"):
        verify(folder)


def test_a_model_whose_adapter_was_swapped_for_a_pickle_loads_without_running_it(
    crashed: Any, tiny: Path, tmp_path: Path
) -> None:
    db, root, _ = crashed
    model = trainer(tiny, "served", max_steps=1).fit(
        X="instruction", Y="output", db=db, select=lt.Table("docs")
    )
    marker = tmp_path / "pwned-adapter"
    folder = db.artifacts.get_dir(model.record.adapter, tmp_path / "adapter")
    (folder / "adapter_model.safetensors").unlink()
    live_torch_pickle(marker, folder / "adapter_model.bin")  # PEFT's legacy name
    evil = db.artifacts.put_dir(folder)
    with sql_engine(db.secret_uri()).begin() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, payload FROM _llmtrain_components "
                "WHERE type_id = 'model' AND identifier = 'served'"
            )
        ).all()
        for key, text in rows:
            payload = {**json.loads(text), "adapter": evil}
            conn.execute(
                sa.text("UPDATE _llmtrain_components SET payload = :p WHERE id = :i"),
                {"p": json.dumps(payload), "i": key},
            )
    with pytest.raises(Exception) as info:  # noqa: PT011 - any refusal will do, if nothing ran
        db.load("model", "served").load(device="cpu")
    assert not marker.exists(), "the pickle ran"
    assert "Weights only load failed" in str(info.value) or "safetensors" in str(info.value)
