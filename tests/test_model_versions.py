"""A trained model's versions: one per fit, none for an unchanged record added again; and
generation reuses one Formatter instead of rebuilding it per call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import fill

import llmtrain as lt
from llmtrain.testing import tiny_model

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(
        tmp_path_factory.mktemp("models") / "llama", hidden_size=32, num_layers=1, vocab_size=400
    )


@pytest.fixture
def db(tmp_path: Path) -> Any:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [{"id": i, "q": f"question {i}", "a": f"answer {i}"} for i in range(8)])
    return lt.connect(uri, artifacts=tmp_path / "artifacts")


def _fit(tiny: Path, db: Any, name: str, **kwargs: Any) -> Any:
    trainer = lt.LLMTrainer(
        name,
        model=str(tiny),
        prompt_template=TEMPLATE,
        max_steps=1,
        batch_size=2,
        lora_r=2,
        progress_bar=False,
    )
    return trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"), **kwargs)


def test_adding_an_unchanged_model_adds_no_version(tiny: Path, db: Any) -> None:
    _fit(tiny, db, "m")
    model = db.load("model", "m")
    db.add(model)
    assert db.show("model", "m") == [0] and model.version == 0
    model.record = model.record.model_copy(update={"history": []})
    db.add(model)
    assert db.show("model", "m") == [0, 1] and model.version == 1


def test_generate_builds_the_formatter_once(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmtrain.formatting as formatting

    built: list[Any] = []
    original = formatting.Formatter

    class Counting(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(formatting, "Formatter", Counting)
    model = _fit(tiny, db, "gen")
    for _ in range(3):
        assert isinstance(model.generate("question 1", max_new_tokens=2), str)
    assert model.generate(["question 1", "question 2"], max_new_tokens=2).__len__() == 2
    assert len(built) == 1 and model.formatter() is built[0]
