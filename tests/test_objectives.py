"""The contract every registered objective keeps, run for each one from the registry: its fields
are checked before anything is recorded, a crashed run resumes to the uninterrupted adapter, a
loaded trainer replays its recipe, and lineage names the rows each run trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill

import llmtrain as lt
from llmtrain.errors import ConfigError
from llmtrain.objectives import OBJECTIVES, Objective

#: each fit() role read from one column of one table, so every objective trains the same rows
COLUMNS = {
    "X": "prompt",
    "Y": "chosen",
    "chosen": "chosen",
    "rejected": "rejected",
    "label": "liked",
}
#: what an objective that samples its answers is scored by: the share of the stored answer's
#: first letter in the answer, computed by the database
REWARD = lt.sql_reward(
    "SELECT (length(:completion) - length(replace(:completion, substr(chosen, 1, 1), ''))) "
    "* 1.0 / max(length(:completion), 1) FROM rows WHERE id = :key"
)
ROWS = [
    {
        "id": i,
        "prompt": f"what color is item {i}",
        "chosen": ["red", "blue", "green", "black"][i % 4],
        "rejected": "unsure",
        "liked": int(i % 3 != 0),
    }
    for i in range(12)
]
OPTIONS: dict[str, Any] = {
    "prompt_template": "Q: {X}\nA: {Y}",
    "max_length": 32,
    "batch_size": 4,
    "learning_rate": 1e-2,
    "lora_dropout": 0.0,
    "progress_bar": False,
    "max_steps": 4,
    "save_steps": 2,
}


def _options(objective: Objective) -> dict[str, Any]:
    """An objective that samples its answers samples 8 tokens (no other takes the setting)."""
    return OPTIONS | ({"max_new_tokens": 8} if objective.generated else {})


def _fields(objective: Objective) -> dict[str, Any]:
    fields: dict[str, Any] = {role: COLUMNS[role] for role in objective.roles}
    return fields | ({"reward": REWARD} if objective.generated else {})


def _weights(db: Any, model: Any, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    db.artifacts.get_dir(model.record.adapter, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_keeps_the_contract(
    name: str, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hooks import crash_after_checkpoint

    objective, uri = OBJECTIVES[name], f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "rows", ROWS)
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    select, fields = lt.Table("rows"), _fields(objective)
    for role in set(objective.roles) - {"X", *objective.optional}:  # a required field left out
        lacking = {k: v for k, v in fields.items() if k != role}
        with pytest.raises(ConfigError, match=f"{role}= missing"):
            lt.LLMTrainer("refused", model=tiny, objective=name, **_options(objective)).fit(
                db=db, select=select, **lacking
            )
    if objective.generated:
        with pytest.raises(ConfigError, match="needs fit.reward="):
            lt.LLMTrainer("refused", model=tiny, objective=name, **_options(objective)).fit(
                db=db, select=select, X="prompt"
            )
    assert db.metadata.list_runs() == []  # refused before anything was recorded

    whole = lt.LLMTrainer("whole", model=tiny, objective=name, **_options(objective))
    model = whole.fit(db=db, select=select, **fields)
    undo = crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        lt.LLMTrainer("crashed", model=tiny, objective=name, **_options(objective)).fit(
            db=db, select=select, **fields
        )
    undo()
    resumed = db.load("trainer", "crashed").fit(resume=True)
    replayed = db.load("trainer", "whole").fit()  # the recorded recipe and selection, again
    assert model is not None and resumed is not None and replayed is not None
    expected = _weights(db, model, tmp_path / "whole")
    for other in (resumed, replayed):
        got = _weights(db, other, tmp_path / f"{other.identifier}-{other.version}")
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    trained = sorted(c.key for c in db.lineage("model", "whole"))  # a use per row and epoch
    assert len(trained) == 4 * 4 and set(trained) == {r["id"] for r in ROWS}
    assert db.trained_on("rows", trained[0]) and not db.trained_on("rows", 999)
    (run, *_) = db.metadata.list_runs("trainer", "whole")
    assert db.metadata.get_run(run.run_id).info["config"]["objective_args"]["objective"] == name
    logged = db.metadata.get_metrics(run.run_id)[0].values  # the objective's loss trained it
    own = {"sft": "loss", "grpo": "reward"}.get(name, "rewards/margins")
    assert own in logged and ("rewards/margins" in logged) == (own == "rewards/margins")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_setting_of_another_objective_is_refused(name: str, tiny: Path) -> None:
    """Each objective's own settings are its module's: set for another, they are refused."""
    for other in OBJECTIVES.values():
        for field in other.settings.model_fields if other.settings else ():
            if other.name == name or field in getattr(
                OBJECTIVES[name].settings, "model_fields", {}
            ):
                continue
            value = next(v for v in (7, 0.3, "none", "t", [0.5]) if _valid(other, field, v))
            with pytest.raises(
                ConfigError, match=f"{field}=.* is a setting of objective='{other.name}'"
            ):
                lt.LLMTrainer("other", model=tiny, objective=name, **{field: value})


def _valid(objective: Objective, field: str, value: Any) -> bool:
    """``value`` is one ``field`` takes, and not its default."""
    assert objective.settings is not None
    try:
        objective.settings(**{field: value})
    except ValueError:
        return False
    return bool(value != objective.settings.model_fields[field].default)


@pytest.mark.parametrize("name", ["sft", "dpo", "kto"])
def test_records_of_the_earlier_schema_load(name: str, tiny: Path) -> None:
    """Before objectives owned their loss types, every record stored loss_type 'sigmoid' (the
    old default, for every objective): such a record loads, its variant the objective's default."""
    trainer = lt.LLMTrainer("old", model=tiny, objective=name)
    stored = trainer.to_dict()
    stored["objective_args"]["loss_type"] = "sigmoid"
    loaded = lt.LLMTrainer.from_dict(stored)
    assert loaded.config.objective_args.loss_type is None and loaded == trainer
