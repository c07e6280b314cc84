"""Continued pre-training: ``fit(X="body")`` with no Y trains a causal LM on the documents'
text. A long document is cut into windows of ``max_length`` (``stride`` tokens of context
repeated, never trained twice), short ones are packed, every token of every document (and
the EOS after it) is a target exactly once an epoch, and a resumed run trains what the
uninterrupted one did."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill
from hooks import KeyTrace, crash_after_checkpoint
from safetensors.torch import load_file
from transformers import AutoTokenizer

import llmtrain as lt
from llmtrain.errors import ConfigError
from llmtrain.formatting import IGNORE_INDEX, Formatter

SENTENCE = "the quick brown fox jumps over the lazy dog while seven red birds sing"
WORDS = SENTENCE.split()


def _document(i: int) -> str:
    """Documents from a few words to several windows long."""
    n = [3, 9, 40, 120, 17, 70][i % 6]
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))


@pytest.mark.parametrize("stride", [0, 5])
def test_every_token_of_a_document_is_a_target_once(tiny: Path, stride: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    formatter = Formatter(tokenizer, None, max_length=16, stride=stride, x_field="body")
    rows = [(i, {"body": _document(i)}) for i in range(12)]
    examples = formatter.format_batch(rows)
    for key, row in rows:
        windows = [e for e in examples if e.key == key]
        tokens = tokenizer(row["body"], add_special_tokens=False)["input_ids"]
        targets = [t for w in windows for t in w.labels if t != IGNORE_INDEX]
        assert targets == [*tokens, tokenizer.eos_token_id], key  # in order, once each
        assert all(len(w) <= 16 and w.labels[0] == IGNORE_INDEX for w in windows)
        assert len(windows) > 1 or len(tokens) + 2 <= 16
        for before, after in zip(windows, windows[1:]):  # the context repeated, untrained
            assert after.input_ids[: 1 + stride] == before.input_ids[-1 - stride :]
            assert after.labels[: 1 + stride] == [IGNORE_INDEX] * (1 + stride)
    assert formatter.prompt("the quick").ids[-1] != tokenizer.eos_token_id
    long = next((key, row) for key, row in rows if sum(e.key == key for e in examples) > 1)
    with pytest.raises(ConfigError, match=r"windows of max_length=16, not one example"):
        formatter.format(long[1], key=long[0])  # never its first window alone
    with pytest.raises(ConfigError, match="stride"):
        Formatter(tokenizer, None, max_length=16, stride=15, x_field="body")


def test_a_template_and_a_fit_must_agree_on_y(tiny: Path, sqlite_uri: str, tmp_path: Path) -> None:
    fill(sqlite_uri, "docs", [{"id": i, "body": _document(i), "y": "x"} for i in range(4)])
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "artifacts")
    with pytest.raises(ConfigError, match=r"prompt_template .* has no \{Y\}"):
        lt.LLMTrainer("a", model=tiny, prompt_template="Text: {X}").fit(
            X="body", Y="y", db=db, select=lt.Table("docs")
        )
    with pytest.raises(ConfigError, match="no Y"):
        lt.LLMTrainer("b", model=tiny, prompt_template="Q: {X}\nA: {Y}").fit(
            X="body", db=db, select=lt.Table("docs")
        )
    with pytest.raises(ConfigError, match="eval_metrics"):
        lt.LLMTrainer(
            "c", model=tiny, eval_metrics=["exact_match"], eval_fraction=0.5, packing=True
        ).fit(X="body", db=db, select=lt.Table("docs"))
    with pytest.raises(ConfigError, match="^[^;]*cannot take data_args.packing=False: a long"):
        lt.LLMTrainer("d", model=tiny, packing=False).fit(X="body", db=db, select=lt.Table("docs"))
    assert db.metadata.list_runs() == []
    plain = lt.LLMTrainer("e", model=tiny, max_steps=1, progress_bar=False)  # packs documents
    assert plain.fit(X="body", db=db, select=lt.Table("docs")) is not None
    assert db.load("trainer", "e").to_dict()["data_args"]["packing"] is True


OPTIONS: dict[str, Any] = {
    "max_length": 32,
    "packing": True,
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "learning_rate": 3e-3,
    "lora_r": 16,
    "lora_dropout": 0.0,
    "save_steps": 2,
    "progress_bar": False,
    "seed": 1,
}


def test_continued_pretraining_feeds_each_token_once_resumes_and_replays(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [{"id": i, "body": _document(i)} for i in range(12)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    from llmtrain.training import run as run_module

    fed: Counter[int] = Counter()
    pair = run_module.FitRun._pair

    def counting(self: Any, group: Any) -> Any:
        for batch in group.batches:
            labels = batch["labels"]
            fed.update(labels[labels != IGNORE_INDEX].tolist())
        return pair(self, group)

    monkeypatch.setattr(run_module.FitRun, "_pair", counting)
    trace = KeyTrace()
    trainer = lt.LLMTrainer("cpt", model=tiny, prompt_template=None, **OPTIONS)
    model = trainer.fit(X="body", db=db, select=lt.Table("docs"), callbacks=[trace])
    assert model is not None
    expected: Counter[int] = Counter()
    for i in range(12):
        expected.update(tokenizer(_document(i), add_special_tokens=False)["input_ids"])
        expected[tokenizer.eos_token_id] += 1
    assert fed == expected  # one epoch: every token and every EOS, once
    # rows, not windows, are what steps, lineage and trained_on count
    assert sorted(trace.keys) == sorted(f"int:{i}" for i in range(12))
    (run,) = db.metadata.list_runs("trainer", "cpt")
    assert run.info["steps"] == 3 and len(list(db.lineage("model", "cpt"))) == 12
    monkeypatch.setattr(run_module.FitRun, "_pair", pair)

    # a crash after the step-2 checkpoint, then a resume: the adapter of the uninterrupted run
    undo = crash_after_checkpoint(monkeypatch, 2)
    again = lt.LLMTrainer("cpt-resumed", model=tiny, prompt_template=None, **OPTIONS)
    with pytest.raises(KeyboardInterrupt):
        again.fit(X="body", db=db, select=lt.Table("docs"))
    undo()
    resumed = db.load("trainer", "cpt-resumed").fit(resume=True)
    assert resumed is not None
    first, second = (_adapter(db, m, tmp_path / m.identifier) for m in (model, resumed))
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)

    # the stored recipe replays (no Y recorded), and the model continues text
    replay = db.load("trainer", "cpt").fit()
    assert replay is not None and replay.version == model.version + 1
    assert db.load("trainer", "cpt").to_dict()["fit"]["Y"] is None


def test_the_tiny_model_learns_to_continue_a_repeated_text(tiny: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    text = "the quick brown fox jumps over the lazy dog"
    fill(uri, "docs", [{"id": i, "body": text} for i in range(16)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    options = {**OPTIONS, "num_train_epochs": 12, "save_steps": 1000}
    model = lt.LLMTrainer("fox", model=tiny, prompt_template=None, **options).fit(
        X="body", db=db, select=lt.Table("docs")
    )
    assert model is not None
    answer = model.generate("the quick brown", max_new_tokens=16)
    assert answer.strip().startswith("fox jumps over"), answer


def _adapter(db: Any, model: Any, folder: Path) -> dict[str, torch.Tensor]:
    db.artifacts.get_dir(model.record.adapter, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


def test_llmtrain_fit_from_yaml_trains_documents(tiny: Path, tmp_path: Path, capsys: Any) -> None:
    import yaml

    from llmtrain.cli import main

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [{"id": i, "body": _document(i)} for i in range(6)])
    config = {
        "name": "cpt-yaml",
        "db": uri,
        "artifacts": str(tmp_path / "artifacts"),
        "model_args": {"model_name_or_path": str(tiny)},
        "training_args": {"max_steps": 2, "per_device_train_batch_size": 2, "progress_bar": False},
        "data_args": {"max_length": 32, "stride": 4, "packing": True},
        "data": {"X": "body", "select": {"table": "docs"}},
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", str(path)]) == 0
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    assert db.load("model", "cpt-yaml").record.prompt_template is None
    (run,) = db.metadata.list_runs("trainer", "cpt-yaml")
    assert run.status == "completed" and run.info["Y"] is None
    where = ["--db", uri, "--artifacts", str(tmp_path / "artifacts")]
    assert main(["show", "trainer", "cpt-yaml", *where]) == 0
    assert "body (documents)" in capsys.readouterr().out
