"""Records stored by an earlier release still load, replay and generate.

``tests/fixtures/release-<version>/`` holds what that release wrote (made by
``make_release_records.py``): a trainer, the model it produced (with its adapter) and the run.
They are inserted as-is into a fresh store; a refactor that changes the stored shape must keep
reading these, or migrate them.
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

FIXTURES = Path(__file__).parent / "fixtures"
RELEASES = sorted(p.name for p in FIXTURES.glob("release-*"))


def _record(release: str, name: str, tiny: Path) -> dict[str, Any]:
    text = (FIXTURES / release / f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text.replace("$TINY_MODEL", str(tiny)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models") / "llama")  # as the fixtures were made


def _restore(db: Any, release: str, tiny: Path) -> dict[str, dict[str, Any]]:
    """Insert the release's records and adapter into ``db`` exactly as they were stored."""
    records = {name: _record(release, name, tiny) for name in ("trainer", "model", "run")}
    rows = json.loads((FIXTURES / release / "rows.json").read_text(encoding="utf-8"))
    fill(db.secret_uri(), "docs", rows)
    for name in ("trainer", "model"):
        rec = records[name]
        assert db.metadata.add_component(rec["type_id"], rec["identifier"], rec["payload"]) == 0
    run = records["run"]
    db.metadata.create_run(run["run_id"], run["type_id"], run["identifier"], run["version"], {})
    db.metadata.update_run(run["run_id"], status=run["status"], info=run["info"])
    adapter = db.artifacts.put_dir(FIXTURES / release / "adapter")
    assert adapter == records["model"]["payload"]["adapter"]  # content ids are stable too
    return records


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _without_new_defaults(loaded: dict[str, Any], stored: dict[str, Any]) -> bool:
    """``loaded == stored`` but for options added since, which must be at their defaults."""
    defaults = lt.LLMTrainer("defaults", model="m", prompt_template="{X}{Y}").to_dict()
    for section, values in loaded.items():
        if isinstance(values, dict) and isinstance(stored.get(section), dict):
            for name in set(values) - set(stored[section]):
                assert values.pop(name) == defaults[section][name], (section, name)
    return loaded == stored


def test_there_is_a_release_to_replay() -> None:
    assert "release-0.1.0" in RELEASES


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
def test_stored_records_load_on_every_sql_store(
    kind: str, release: str, tiny: Path, tmp_path: Path
) -> None:
    from conftest import fresh_database

    databases = fresh_database(kind, tmp_path)
    uri = next(databases)
    try:
        db = lt.connect(uri, artifacts=tmp_path / "artifacts")
        records = _restore(db, release, tiny)
        trainer = db.load("trainer", "recorded")
        assert _without_new_defaults(trainer.to_dict(), records["trainer"]["payload"])
        model = db.load("model", "recorded")
        assert model.to_dict() == records["model"]["payload"]
        (run,) = db.metadata.list_runs("trainer", "recorded")
        assert run.info == records["run"]["info"] and run.status == "completed"
        db.close()
    finally:
        databases.close()


def test_stored_trainer_replays_and_stored_model_generates(
    release: str, tiny: Path, tmp_path: Path
) -> None:
    db = lt.connect(f"sqlite:///{tmp_path / 'data.db'}", artifacts=tmp_path / "artifacts")
    records = _restore(db, release, tiny)

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
