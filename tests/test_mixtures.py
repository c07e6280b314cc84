"""Weighted mixtures: ``select=lt.mix(a, b, weights=...)`` trains several sources of one
database together, each in its own shape (documents, prompt and response, conversations).
Each source keeps its own snapshot; each step's rows are drawn by the weights in a seeded,
even interleave; a source that runs out starts its next pass in a new order; resume, lineage,
``trained_on`` and ``forget`` speak per source."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import fill
from hooks import KeyTrace, crash_after_checkpoint
from safetensors.torch import load_file
from transformers import AutoTokenizer

import llmtrain as lt
from llmtrain.data.plan import MixOrder
from llmtrain.errors import ConfigError, QueryError
from llmtrain.formatting import IGNORE_INDEX, Formatter

TEMPLATE = "Q: {X}\nA: {Y}"
OPTIONS: dict[str, Any] = {
    "prompt_template": TEMPLATE,
    "packing": True,  # the documents' windows are packed
    "max_length": 32,
    "batch_size": 4,
    "max_steps": 50,  # 200 rows: 100 of each source at 0.5/0.5
    "save_steps": 25,
    "learning_rate": 3e-3,
    "lora_r": 8,
    "lora_dropout": 0.0,
    "progress_bar": False,
    "seed": 3,
}


def _docs(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "body": f"document {i} tells of the fox and the dog"} for i in range(n)]


def _qa(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "q": f"what is {i} plus one", "a": f"it is {i + 1}"} for i in range(n)]


def _mix(big: Any = None, small: Any = None, **kwargs: Any) -> lt.Mix:
    return lt.mix(
        (big or lt.Table("big")).fields(X="body"),
        (small or lt.Table("small")).fields(X="q", Y="a"),
        weights=kwargs.pop("weights", [0.5, 0.5]),
        **kwargs,
    )


def _docs_part() -> lt.db.queries.Part:
    return lt.Table("big").fields(X="body")


def _part(key: str) -> int:
    """The source of a traced key (``dict:{'part': 1, 'key': 5}``)."""
    return int(key.split("'part': ")[1].split(",")[0])


def test_the_interleave_follows_the_weights_and_walks_each_source_in_passes() -> None:
    order = MixOrder(500, 64, 7, counts=(400, 100), weights=(0.5, 0.5))
    streams: list[list[np.ndarray]] = [[], []]
    for epoch in range(3):
        indexes = order.epoch(epoch)
        small = indexes >= 400
        ahead = np.cumsum(small) - np.arange(1, 501) * 0.5  # small rows ahead of their share
        assert np.abs(ahead).max() <= 1.5  # even through the epoch, not just in total
        assert abs(int(small[:200].sum()) - 100) <= 3
        streams[0].append(indexes[~small])
        streams[1].append(indexes[small] - 400)
    big, little = (np.concatenate(s) for s in streams)
    assert len(little) == 750  # up-sampled: 7.5 passes of the small source in 3 epochs
    for start in range(0, 700, 100):  # each pass holds every row once: no repeat before all
        assert sorted(little[start : start + 100].tolist()) == list(range(100))
    assert sorted(big[:400].tolist()) == list(range(400))  # sub-sampled, in passes too
    assert not np.array_equal(little[:100], little[100:200])  # a new pass, a new order
    # ranks split each epoch's interleave; locate finds a row where it is read
    two = MixOrder(500, 64, 7, world_size=2, counts=(400, 100), weights=(0.5, 0.5))
    first, second = two.indexes(0, 0), two.indexes(0, 1)
    assert np.array_equal(np.concatenate([first, second]), order.epoch(0))
    assert (1, 3) in two.locate(int(second[3]), 0)
    # weights, epoch_rows and an empty source
    assert MixOrder(40, 8, counts=(10, 10), weights=(3, 1)).shares().tolist() == [30, 10]
    assert MixOrder(40, 8, counts=(0, 10), weights=(3, 1)).shares().tolist() == [0, 40]


def test_a_mixture_trains_each_source_in_its_shape_by_weight(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "big", _docs(400))
    fill(uri, "small", _qa(100))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    from llmtrain.training import run as run_module

    fed = [0]
    pair = run_module.FitRun._pair

    def counting(self: Any, group: Any) -> Any:
        fed[0] += sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in group.batches)
        return pair(self, group)

    monkeypatch.setattr(run_module.FitRun, "_pair", counting)
    trace = KeyTrace()
    model = lt.LLMTrainer("mx", model=tiny, **OPTIONS).fit(db=db, select=_mix(), callbacks=[trace])
    monkeypatch.setattr(run_module.FitRun, "_pair", pair)
    assert model is not None
    keys = trace.keys
    by_part = Counter(map(_part, keys))
    assert len(keys) == 200 and abs(by_part[0] - 100) <= 3 and abs(by_part[1] - 100) <= 3
    assert len(set(keys)) == 200  # neither source repeats a row within its pass
    # each source in its own shape: documents train every token (and EOS), answers only Y
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    documents = Formatter(tokenizer, None, max_length=32, x_field="body")
    answers = Formatter(tokenizer, TEMPLATE, max_length=32, x_field="q", y_field="a")
    rows = {0: dict(enumerate(_docs(400))), 1: dict(enumerate(_qa(100)))}
    expected = 0
    for entry in db.lineage("model", "mx"):
        formatter = documents if entry.key["part"] == 0 else answers
        made = formatter.format(rows[entry.key["part"]][entry.key["key"]])
        expected += made.num_target_tokens
    assert fed[0] == expected
    # lineage per source: the same key in the other source is another row
    (run,) = db.metadata.list_runs("trainer", "mx")
    assert run.info["sources"] == ["main.big(id)", "main.small(id)"]
    small = {int(k.split("'key': ")[1].rstrip("}")) for k in keys if _part(k) == 1}
    big = {int(k.split("'key': ")[1].rstrip("}")) for k in keys if _part(k) == 0}
    only_small = min(small - big)
    assert [u.key for u in db.trained_on("small", only_small).uses] == [only_small]
    assert not db.trained_on("big", only_small) and db.trained_on("big", min(big))

    # a replay trains the very same rows at the very same steps
    replay = db.load("trainer", "mx").fit()
    assert replay is not None and replay.version == model.version + 1
    again = [(c.key, c.step) for c in db.lineage("model", "mx", replay.version)]
    assert again == [(c.key, c.step) for c in db.lineage("model", "mx", model.version)]

    # a crash after the step-25 checkpoint, then a resume: the same interleave, the same adapter
    undo = crash_after_checkpoint(monkeypatch, 25)
    resumed_trace = KeyTrace()
    with pytest.raises(KeyboardInterrupt):
        lt.LLMTrainer("mx-resumed", model=tiny, **OPTIONS).fit(db=db, select=_mix())
    undo()
    resumed = db.load("trainer", "mx-resumed").fit(resume=True, callbacks=[resumed_trace])
    assert resumed is not None
    assert resumed_trace.steps == trace.steps[25:]
    first, second = (_adapter(db, m, tmp_path / m.identifier) for m in (model, resumed))
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)


def _adapter(db: Any, model: Any, folder: Path) -> dict[str, torch.Tensor]:
    db.artifacts.get_dir(model.record.adapter, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


def test_a_mixture_reads_each_source_by_key_on_every_backend(
    any_uri: str, tiny: Path, tmp_path: Path
) -> None:
    fill(any_uri, "big", _docs(40))
    fill(any_uri, "small", _qa(10))
    mongo = any_uri.startswith("mongo")
    big, small = (lt.Collection(n) if mongo else lt.Table(n) for n in ("big", "small"))
    mixed = _mix(big, small, weights=[3, 1], epoch_rows=40)
    db = lt.connect(any_uri)
    ds = lt.CachedQueryDataset(db, mixed, ["body"], return_keys=True, cache_size=8, seed=1)
    rows = list(ds)
    assert Counter(r["_key"]["part"] for r in rows) == {0: 30, 1: 10}
    for row in rows:  # each row has its own source's fields, under its own key
        part, key = row.pop("_key").values()
        source = _docs(40)[key] if part == 0 else _qa(10)[key]
        assert row == {f: source[f] for f in (["body"] if part == 0 else ["q", "a"])}
    # a fit on it: lineage names each source's rows, and the run its sources
    db = lt.connect(any_uri, artifacts=tmp_path / "artifacts")
    options = {**OPTIONS, "max_steps": 3, "save_steps": 100}
    lt.LLMTrainer("mx-any", model=tiny, **options).fit(db=db, select=mixed)
    consumed = list(db.lineage("model", "mx-any"))
    assert len(consumed) == 12 and {c.key["part"] for c in consumed} == {0, 1}


def test_default_weights_are_the_sources_sizes_and_an_empty_weighted_source_is_refused(
    tiny: Path, tmp_path: Path
) -> None:
    """Without weights an epoch is every row once, as concatenating the sources would give; a
    source with a weight but no rows is refused before anything is recorded."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "big", _docs(40))
    fill(uri, "small", _qa(10))
    fill(uri, "none", _qa(1))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    plain = lt.mix(_docs_part(), lt.Table("small").fields(X="q", Y="a"))
    assert (
        plain.to_dict()["weights"] is None and lt.Query.from_dict(plain.to_dict()).weights is None
    )
    for epoch in range(2):
        ds = lt.CachedQueryDataset(db, plain, ["body"], return_keys=True, seed=epoch)
        ds.set_epoch(epoch)
        keys = [(r["_key"]["part"], r["_key"]["key"]) for r in ds]
        assert sorted(keys) == [(0, i) for i in range(40)] + [(1, i) for i in range(10)]
    trainer = lt.LLMTrainer("mx-empty", model=tiny, **OPTIONS)
    empty = lt.Table("none").where("id > 5").fields(X="q", Y="a")
    with pytest.raises(lt.DataError, match=r"^mix\(\): table none .*no rows, but weight 1$"):
        trainer.fit(db=db, select=lt.mix(_docs_part(), empty, weights=[3, 1]))
    assert db.metadata.list_runs("trainer", "mx-empty") == []


def test_forgetting_a_row_of_one_source_leaves_it_out_of_the_next_mixture(
    tiny: Path, tmp_path: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "big", _docs(40))
    fill(uri, "small", _qa(10))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    options = {**OPTIONS, "max_steps": -1, "num_train_epochs": 1, "save_steps": 100}
    lt.LLMTrainer("mx-forget", model=tiny, **options).fit(db=db, select=_mix())
    found = db.forget("small", [3, 4])
    assert found.runs and found.trainers == [("mx-forget", 0)]
    retrained = db.load("trainer", "mx-forget").fit(allow_changed_data=True)
    assert retrained is not None
    keys = [c.key for c in db.lineage("model", "mx-forget", retrained.version)]
    assert {"part": 1, "key": 3} not in keys and {"part": 0, "key": 3} in keys
    run = db.metadata.list_runs("trainer", "mx-forget")[-1]
    assert run.info["forgets"] == {"main.small(id)": {"keys": 2, "version": 0}}
    assert run.info["reads"] == [["main.big"], ["main.small"]]


def test_llmtrain_fit_trains_a_mixture_from_yaml(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from llmtrain.cli import main

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "big", _docs(12))
    fill(uri, "small", _qa(4))
    config = {
        "name": "mx-yaml",
        "db": uri,
        "artifacts": str(tmp_path / "artifacts"),
        "prompt_template": TEMPLATE,
        "model_args": {"model_name_or_path": str(tiny)},
        "training_args": {"max_steps": 2, "per_device_train_batch_size": 4, "progress_bar": False},
        "data_args": {"max_length": 32, "packing": True},
        "data": {
            "select": {
                "mix": [{"table": "big", "X": "body"}, {"table": "small", "X": "q", "Y": "a"}],
                "weights": [0.75, 0.25],
            }
        },
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", str(path)]) == 0
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    stored = db.load("trainer", "mx-yaml").to_dict()["fit"]
    assert stored["X"] == "body" and stored["select"] == _mix(weights=[0.75, 0.25]).to_dict()
    assert Counter(c.key["part"] for c in db.lineage("model", "mx-yaml")) == {0: 6, 1: 2}
    capsys.readouterr()
    assert main(["show", "trainer", "mx-yaml", "--db", uri]) == 0  # and its newest run
    shown = "body (documents) from table big; q -> a from table small"
    assert capsys.readouterr().out.count(shown) == 2


def test_a_mixture_refuses_what_it_cannot_train(
    tiny: Path, sqlite_uri: str, tmp_path: Path
) -> None:
    from llmtrain.config.file import build_query

    fill(sqlite_uri, "big", _docs(8))
    fill(sqlite_uri, "small", _qa(4))
    db = lt.connect(sqlite_uri, artifacts=tmp_path / "artifacts")
    with pytest.raises(QueryError, match="at least two"):
        lt.mix(lt.Table("big"))
    with pytest.raises(QueryError, match="one positive number for each"):
        lt.mix(lt.Table("big"), lt.Table("small"), weights=[1, 0])
    with pytest.raises(QueryError, match="a source is a llmtrain query"):
        lt.mix(_mix(), lt.Table("big"))
    with pytest.raises(ConfigError, match=r"data.select.mix\[1\]"):
        build_query({"mix": [{"table": "big"}, {"tabel": "small"}]})
    # in the file's words, not Python's (list('3:1'), __init__() missing an argument)
    with pytest.raises(ConfigError, match=r"^data.select: mix\(weights='3:1'\): one positive"):
        build_query({"mix": [{"table": "big"}, {"table": "small"}], "weights": "3:1"})
    with pytest.raises(ConfigError, match="^data.select: conversations: needs by:$"):
        build_query({"conversations": {"table": "messages"}, "order": "turn"})
    trainer = lt.LLMTrainer("mx-bad", model=tiny, **OPTIONS)
    with pytest.raises(ConfigError, match="incremental"):
        trainer.fit(db=db, select=_mix(), incremental=True)
    with pytest.raises(ConfigError, match="eval_select= takes one source"):
        trainer.fit(db=db, select=_mix(), eval_select=_mix())
    with pytest.raises(QueryError, match="table small has no column 'body'"):
        trainer.fit(db=db, select=lt.mix(lt.Table("small").fields("body"), _docs_part()))
    with pytest.raises(ConfigError, match=r"needs X= \(and Y=\) for its sources without"):
        trainer.fit(db=db, select=lt.mix(lt.Table("small"), lt.Table("big")))
    assert db.metadata.list_runs() == []
