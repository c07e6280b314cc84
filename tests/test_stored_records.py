"""Records of the one stored format load, replay and generate, and derive their lineage.

``tests/fixtures/records/`` holds what llmtrain stores (made by ``make_release_records.py``):
a trainer, the model it produced (with its adapter), the run and its key snapshot. They are
inserted as-is into a fresh store: a change that changes the stored shape fails here until the
fixtures are made anew (and, once a release has shipped the format, until it reads the old).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill

import llmtrain as lt
from llmtrain.testing import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "records"


def _record(name: str, tiny: Path) -> dict[str, Any]:
    text = (FIXTURES / f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text.replace("$TINY_MODEL", str(tiny)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models") / "llama")  # as the fixtures were made


def _restore(db: Any, tiny: Path) -> dict[str, dict[str, Any]]:
    """Insert the records and artifacts into ``db`` exactly as they were stored."""
    records = {name: _record(name, tiny) for name in ("trainer", "model", "run")}
    rows = json.loads((FIXTURES / "rows.json").read_text(encoding="utf-8"))
    fill(db.secret_uri(), "docs", rows)
    for name in ("trainer", "model"):
        rec = records[name]
        assert db.metadata.add_component(rec["type_id"], rec["identifier"], rec["payload"]) == 0
    run = records["run"]
    db.metadata.create_run(run["run_id"], run["type_id"], run["identifier"], run["version"], {})
    db.metadata.update_run(run["run_id"], status=run["status"], info=run["info"])
    adapter = db.artifacts.put_dir(FIXTURES / "adapter")
    assert adapter == records["model"]["payload"]["adapter"]  # content ids are stable too
    for blob in sorted((FIXTURES / "artifacts").iterdir()):
        assert db.artifacts.put_bytes(blob.read_bytes()) == blob.name.replace("-", ":", 1)
    return records


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
def test_stored_records_load_on_every_sql_store(kind: str, tiny: Path, tmp_path: Path) -> None:
    from conftest import fresh_database

    databases = fresh_database(kind, tmp_path)
    uri = next(databases)
    try:
        db = lt.connect(uri, artifacts=tmp_path / "artifacts")
        records = _restore(db, tiny)
        trainer = db.load("trainer", "recorded")
        assert trainer.to_dict() == records["trainer"]["payload"]
        model = db.load("model", "recorded")
        assert model.to_dict() == records["model"]["payload"]
        (run,) = db.metadata.list_runs("trainer", "recorded")
        assert run.info == records["run"]["info"] and run.status == "completed"
        db.close()
    finally:
        databases.close()


def test_stored_trainer_replays_and_stored_model_generates(tiny: Path, tmp_path: Path) -> None:
    db = lt.connect(f"sqlite:///{tmp_path / 'data.db'}", artifacts=tmp_path / "artifacts")
    records = _restore(db, tiny)
    lineage = list(db.lineage("model", "recorded"))  # derived from the stored run alone
    assert len(lineage) == 3 * 4 and {row.step for row in lineage} == {1, 2, 3}

    model = db.load("model", "recorded")
    answer = model.generate("What is color number 2?", max_new_tokens=4)
    assert isinstance(answer, str)

    replayed = db.load("trainer", "recorded").fit()
    runs = db.metadata.list_runs("trainer", "recorded")
    assert [r.status for r in runs] == ["completed", "completed"]
    old, new = runs
    assert new.info["data_fingerprint"] == old.info["data_fingerprint"]
    assert new.info["steps"] == old.info["steps"]
    losses = [m.values["loss"] for m in db.metadata.get_metrics(new.run_id)]
    recorded = [h["loss"] for h in records["model"]["payload"]["history"]]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(recorded, dtype=torch.float64),
        rtol=1e-4,
        atol=1e-5,
    )
    # the recipe names the database it was fitted on: here another one than at recording
    assert db.show("model", "recorded") == [0, 1] and replayed.version == 1
