"""Preference tuning through fit(): ``objective="dpo"`` (against the model with its adapter
off), ``"orpo"`` and ``"simpo"`` (reference-free) on rows of (prompt, chosen, rejected). Each
pair's two answers are rendered by the SFT formatter and trained in one forward; the step
is normalised by pairs; the run, lineage and replay are SFT's."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill
from transformers import AutoModelForCausalLM, AutoTokenizer

import llmtrain as lt
from llmtrain.errors import BadRowError, ConfigError
from llmtrain.formatting import IGNORE_INDEX, Formatter

TEMPLATE = "Q: {X}\nA: {Y}"
COLORS = ["red", "blue", "green", "black"]
ROWS = [
    {"id": i, "prompt": f"what color is item {i}", "chosen": COLORS[i % 4], "rejected": "unsure"}
    for i in range(8)
]
OPTIONS: dict[str, Any] = {
    "prompt_template": TEMPLATE,
    "max_length": 32,
    "batch_size": 4,
    "learning_rate": 1e-2,
    "lora_dropout": 0.0,
    "logging_steps": 1,
    "progress_bar": False,
}
FIELDS = {"X": "prompt", "chosen": "chosen", "rejected": "rejected"}


def _db(tmp_path: Path, rows: list[dict[str, Any]] = ROWS) -> Any:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "feedback", rows)
    return lt.connect(uri, artifacts=tmp_path / "artifacts")


def _margins(folder: Path | str, tokenizer: Any) -> list[float]:
    """log p(chosen) - log p(rejected) of each pair, by stock transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    formatter = Formatter(tokenizer, TEMPLATE, max_length=32, x_field="prompt", y_field="a")
    out = []
    for row in ROWS:
        sums = []
        for answer in (row["chosen"], row["rejected"]):
            example = formatter.format({"prompt": row["prompt"], "a": answer})
            ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
            with torch.no_grad():
                logps = model(ids).logits[:, :-1].log_softmax(-1)
            targets = labels[:, 1:]
            keep = targets != IGNORE_INDEX
            sums.append(
                float(logps.gather(-1, targets.clamp(min=0)[..., None])[..., 0][keep].sum())
            )
        out.append(sums[0] - sums[1])
    return out


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
def test_preference_tuning_widens_every_pairs_margin(
    objective: str, tiny: Path, tmp_path: Path
) -> None:
    db = _db(tmp_path)
    trainer = lt.LLMTrainer(
        objective, model=tiny, objective=objective, num_train_epochs=8, **OPTIONS
    )
    model = trainer.fit(db=db, select=lt.Table("feedback"), **FIELDS)
    assert model is not None
    (run,) = db.metadata.list_runs("trainer", objective)
    metrics = [m.values for m in db.metadata.get_metrics(run.run_id)]
    assert len(metrics) == 16 and all("rewards/margins" in m for m in metrics)
    if objective == "dpo":  # a fresh adapter is the reference: ln 2, no margin
        assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model.export_merged(tmp_path / "merged")
    merged = tmp_path / "merged"
    before, after = _margins(tiny, tokenizer), _margins(merged, tokenizer)
    assert all(b < a for b, a in zip(before, after)), list(zip(before, after))
    # the feedback rows are the lineage; the stored recipe replays
    assert sorted(c.key for c in db.lineage("model", objective)) == sorted(list(range(8)) * 8)
    stored = db.load("trainer", objective)
    assert stored.to_dict()["fit"]["rejected"] == "rejected"
    assert stored.to_dict()["objective_args"]["objective"] == objective
    if objective == "dpo":
        again = stored.fit()
        assert again is not None and again.version == model.version + 1


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_packed_and_padded_rows_train_alike(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, objective: str
) -> None:
    """Packed padding-free, 2-4 sequences a row, each token knows its sequence and position:
    the same losses as padded rows."""
    from llmtrain.objectives import preference

    db = _db(tmp_path, ROWS if objective == "dpo" else FEEDBACK)
    fields = FIELDS if objective == "dpo" else KTO_FIELDS
    per_row: list[int] = []  # sequences in each packed row the policy's forward reads
    compute = preference.sequence_logprobs

    def counted(model: Any, batch: dict[str, Any], **kwargs: Any) -> Any:
        if "sequence_index" in batch and torch.is_grad_enabled():
            labels = batch["labels"] != IGNORE_INDEX
            per_row.extend(len(set(i[t].tolist())) for i, t in zip(batch["sequence_index"], labels))
        return compute(model, batch, **kwargs)

    monkeypatch.setattr(preference, "sequence_logprobs", counted)
    losses = []
    for packing in (False, True):
        name = f"{objective}-packed-{packing}"
        options = {**OPTIONS, "packing": packing, "max_steps": 3, "max_length": 96}
        lt.LLMTrainer(name, model=tiny, objective=objective, **options).fit(
            db=db, select=lt.Table("feedback"), **fields
        )
        (run,) = db.metadata.list_runs("trainer", name)
        losses.append([m.values["loss"] for m in db.metadata.get_metrics(run.run_id)])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert losses[0][0] != losses[0][-1]
    assert max(per_row) >= 3 and per_row.count(1) <= len(per_row) / 4, per_row


def test_a_dpo_run_resumes_to_the_same_adapter_and_evaluates_preferences(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hooks import crash_after_checkpoint
    from safetensors.torch import load_file

    db = _db(tmp_path, [*ROWS, *({**r, "id": r["id"] + 8} for r in ROWS)])
    options = {**OPTIONS, "max_steps": 4, "save_steps": 2, "eval_fraction": 0.25, "eval_steps": 2}
    options["save_best_by"] = "rewards/margins"  # the best checkpoint by a preference metric
    whole = lt.LLMTrainer("dpo-whole", model=tiny, objective="dpo", **options)
    model = whole.fit(db=db, select=lt.Table("feedback"), **FIELDS)
    (run,) = db.metadata.list_runs("trainer", "dpo-whole")
    evaluated = [m.values for m in db.metadata.get_metrics(run.run_id) if "eval_loss" in m.values]
    assert len(evaluated) == 2
    assert all(0 <= m["eval_rewards/accuracies"] <= 1 for m in evaluated)
    best = db.metadata.get_run(run.run_id).info["best_checkpoint"]
    assert best["metric"] == "eval_rewards/margins"
    assert best["value"] == max(m["eval_rewards/margins"] for m in evaluated)
    undo = crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        lt.LLMTrainer("dpo-resumed", model=tiny, objective="dpo", **options).fit(
            db=db, select=lt.Table("feedback"), **FIELDS
        )
    undo()
    resumed = db.load("trainer", "dpo-resumed").fit(resume=True)
    assert model is not None and resumed is not None
    weights = []
    for m in (model, resumed):
        db.artifacts.get_dir(m.record.adapter, tmp_path / m.identifier)
        weights.append(load_file(str(tmp_path / m.identifier / "adapter_model.safetensors")))
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=0)


@pytest.fixture
def references(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each reference forward, as they run (the policy's forward has grad)."""
    from llmtrain.objectives import preference

    counts: list[int] = []
    compute = preference.sequence_logprobs

    def counted(model: Any, batch: dict[str, Any], **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            counts.append(int(batch["pairs"]))
        return compute(model, batch, **kwargs)

    monkeypatch.setattr(preference, "sequence_logprobs", counted)
    return counts


def test_reference_log_probs_are_computed_once_per_pair_and_kept(
    tiny: Path, tmp_path: Path, references: list[int]
) -> None:
    """A second epoch and a replay run no reference forward for the pairs already seen (the
    values come from the artifact store), and train the same; a pair whose text changed is
    computed again, with its micro-batch."""
    import sqlite3

    db = _db(tmp_path)
    options = {**OPTIONS, "num_train_epochs": 2, "shuffle": False}
    lt.LLMTrainer("cached", model=tiny, objective="dpo", **options).fit(
        db=db, select=lt.Table("feedback"), **FIELDS
    )
    assert references == [4, 4]  # the first epoch's two micro-batches, then none

    def losses(run: Any) -> list[float]:
        return [m.values["loss"] for m in db.metadata.get_metrics(run.run_id)]

    references.clear()
    db.load("trainer", "cached").fit()
    first, replay = db.metadata.list_runs("trainer", "cached")
    assert references == [] and losses(replay) == losses(first)
    with sqlite3.connect(tmp_path / "data.db") as conn:
        conn.execute("UPDATE feedback SET chosen = 'violet' WHERE id = 6")
    db.load("trainer", "cached").fit(allow_changed_data=True)
    assert references == [4]  # rows 4-7, once
    references.clear()  # a forgotten pair is not trained, so its kept values are never read
    db.forget("feedback", [2])
    forgetting = db.load("trainer", "cached").fit(allow_changed_data=True)
    assert references == [] and forgetting is not None
    assert 2 not in {c.key for c in db.lineage("model", "cached", forgetting.version)}


def test_reference_values_kept_in_another_artifact_store_are_computed_again(
    tiny: Path, tmp_path: Path, references: list[int]
) -> None:
    """One database, two artifact stores (two machines): the values one store keeps are a miss
    on the other, computed there and kept there; each store then reads its own."""
    here = _db(tmp_path)
    there = lt.connect(here.uri, artifacts=tmp_path / "elsewhere")
    computed = []
    for db in (here, there, here, there):
        references.clear()
        model = lt.LLMTrainer("dpo", model=tiny, objective="dpo", max_steps=2, **OPTIONS).fit(
            db=db, select=lt.Table("feedback"), **FIELDS
        )
        computed.append(references[:])
        assert model is not None
    assert computed == [[4, 4], [4, 4], [], []]


def test_a_resumed_run_reads_the_reference_values_its_crashed_attempt_kept(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, references: list[int]
) -> None:
    """The values are kept with each checkpoint: an attempt that crashed after epoch 1's leaves
    them for the resumed one, whose epoch 2 runs no reference forward."""
    from hooks import crash_after_checkpoint

    db = _db(tmp_path)
    options = {**OPTIONS, "num_train_epochs": 2, "save_steps": 2}
    undo = crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        lt.LLMTrainer("crashed", model=tiny, objective="dpo", **options).fit(
            db=db, select=lt.Table("feedback"), **FIELDS
        )
    undo()
    assert references == [4, 4]  # epoch 1's two micro-batches
    references.clear()
    resumed = db.load("trainer", "crashed").fit(resume=True)
    assert resumed is not None and references == []


@pytest.mark.parametrize("shape", ["pairs", "feedback"])
def test_a_row_with_nothing_to_learn_from_is_a_bad_row(
    shape: str, tiny: Path, tmp_path: Path
) -> None:
    """Answers equal or empty, a label that is no label: raised naming the key and field, or
    skipped and left out of the lineage."""
    if shape == "pairs":
        rows, objective, fields, steps = [*ROWS], "simpo", FIELDS, 2
        rows[3] = {**rows[3], "rejected": rows[3]["chosen"]}
        rows[5] = {**rows[5], "rejected": "  "}
        message, kept = r"key 3: field 'rejected' equals field 'chosen'", [0, 1, 2, 4, 6, 7]
    else:
        rows, objective, fields, steps = [*FEEDBACK], "kto", KTO_FIELDS, 3
        rows[2] = {**rows[2], "liked": "yes"}
        rows[9] = {**rows[9], "answer": " "}
        message, kept = r"key 2: field 'liked' is 'yes', not a label", [0, 1, *range(3, 9), 10, 11]
    db = _db(tmp_path, rows)
    options = {**OPTIONS, "max_steps": steps, "shuffle": False, "objective": objective}
    with pytest.raises(BadRowError, match=message):
        lt.LLMTrainer("bad", model=tiny, **options).fit(
            db=db, select=lt.Table("feedback"), **fields
        )
    skipping = lt.LLMTrainer("skip", model=tiny, on_bad_row="skip", **options)
    skipping.fit(db=db, select=lt.Table("feedback"), **fields)
    assert sorted(c.key for c in db.lineage("model", "skip")) == kept


def test_preference_options_are_checked_before_anything_is_recorded(
    tiny: Path, tmp_path: Path
) -> None:
    db = _db(tmp_path)
    select = lt.Table("feedback")
    cases = [
        ({"objective": "dpo"}, {"X": "prompt", "Y": "chosen"}, "chosen= and rejected= missing"),
        ({"objective": "dpo"}, {"X": "prompt", "chosen": "chosen"}, "^[^;]*: rejected= missing"),
        ({}, FIELDS, "set objective='dpo', 'orpo' or 'simpo'"),
        ({"objective": "dpo", "lora_args": None}, FIELDS, "the reference is the model with its"),
        ({"objective": "dpo", "loss_type": "kto"}, FIELDS, "loss_type"),
        ({"objective": "orpo"}, {**FIELDS, "rejected": "chosen"}, "name the same field twice"),
        (
            {"objective": "kto", "batch_size": 1},
            KTO_FIELDS,
            "per_device_train_batch_size=1: KTO's KL estimate",
        ),
        ({"objective": "dpo"}, KTO_FIELDS, "fit.label=. trains feedback on single answers"),
        ({"objective": "kto"}, {"X": "prompt", "Y": "chosen"}, "kto' trains .*: label= missing"),
        (
            {"save_best_by": "eval_rewards/margins", "eval_fraction": 0.5},
            {"X": "prompt", "Y": "chosen"},
            "rewards are a preference objective's",
        ),
    ]
    for options, fields, message in cases:
        full = {k: v for k, v in {**OPTIONS, **options}.items() if k != "lora_dropout"}
        with pytest.raises(ConfigError, match=message):
            lt.LLMTrainer("refused", model=tiny, **full).fit(db=db, select=select, **fields)
    with pytest.raises(ConfigError, match="init_from='sft': this database has no model 'sft'"):
        lt.LLMTrainer("refused", model=tiny, objective="dpo", init_from="sft", **OPTIONS).fit(
            db=db, select=select, **FIELDS
        )
    assert db.metadata.list_runs() == []


def test_dpo_from_an_sft_model_has_that_model_as_its_reference(tiny: Path, tmp_path: Path) -> None:
    """init_from= starts from an earlier model's adapter, and DPO's reference is that model,
    not the bare base: at step 1 the policy is the reference (ln 2, no margin). The version
    started from is pinned in the recipe, the new model's lineage holds the SFT rows, and an
    incremental DPO fit on new pairs has its parent as reference (ln 2 again)."""
    from safetensors.torch import load_file

    db = _db(tmp_path)
    options = {**OPTIONS, "max_steps": 4}
    sft = lt.LLMTrainer("sft", model=tiny, **options)
    sft.fit(db=db, select=lt.Table("feedback"), X="prompt", Y="chosen")
    dpo = lt.LLMTrainer("dpo", model=tiny, objective="dpo", init_from="sft", **options)
    model = dpo.fit(db=db, select=lt.Table("feedback").where("id < 6"), **FIELDS)
    assert model is not None
    (run,) = db.metadata.list_runs("trainer", "dpo")
    assert run.info["parent"]["model_version"] == 0 and run.info["config"]["init_from"] == "sft:0"
    assert db.load("trainer", "dpo").to_dict()["init_from"] == "sft:0"
    first = db.metadata.get_metrics(run.run_id)[0].values
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(
        ConfigError, match="init_from='sft:0': the model sft v0 has an adapter with r=8"
    ):
        lt.LLMTrainer("r4", model=tiny, objective="dpo", init_from="sft", **options, lora_r=4).fit(
            db=db, select=lt.Table("feedback"), **FIELDS
        )
    bare = lt.LLMTrainer("bare", model=tiny, objective="dpo", **options)  # against the base
    bare.fit(db=db, select=lt.Table("feedback").where("id < 6"), **FIELDS)
    (other,) = db.metadata.list_runs("trainer", "bare")
    assert db.metadata.get_metrics(other.run_id)[0].values["loss"] == pytest.approx(math.log(2))
    assert [c.key for c in db.lineage("model", "dpo")][:16] == [
        c.key for c in db.lineage("model", "sft")
    ]
    db.artifacts.get_dir(model.record.adapter, tmp_path / "adapter")
    stored = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert stored and not [name for name in stored if "reference" in name]
    more = dpo.fit(db=db, select=lt.Table("feedback"), incremental=True, **FIELDS)
    assert more is not None
    for i, trained in enumerate([model, more]):  # the trained adapter alone, stored and exported
        for folder in (tmp_path / f"stored{i}", trained.export_adapter(tmp_path / f"export{i}")):
            if not folder.exists():
                db.artifacts.get_dir(trained.record.adapter, folder)
            files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
            weights = [f for f in files if "adapter" in f or "/" in f]  # the prompt's files aside
            assert weights == ["adapter_config.json", "adapter_model.safetensors"], files
            config = json.loads((folder / "adapter_config.json").read_text())
            assert config["target_modules"] == sorted(config["target_modules"])
    newest = db.metadata.list_runs("trainer", "dpo")[-1]
    assert newest.info["parent"]["run_id"] == run.run_id
    assert db.metadata.get_metrics(newest.run_id)[0].values["loss"] == pytest.approx(
        math.log(2), abs=1e-5
    )


def test_llmtrain_fit_trains_preferences_from_yaml(tiny: Path, tmp_path: Path, capsys: Any) -> None:
    import yaml

    from llmtrain.cli import main

    db = _db(tmp_path)
    config = {
        "name": "dpo-yaml",
        "db": db.uri,
        "artifacts": str(tmp_path / "artifacts"),
        "prompt_template": TEMPLATE,
        "model_args": {"model_name_or_path": str(tiny)},
        "objective_args": {"objective": "dpo", "beta": 0.2, "loss_type": "ipo"},
        "training_args": {"max_steps": 2, "per_device_train_batch_size": 4, "progress_bar": False},
        "data": {**FIELDS, "select": {"table": "feedback"}},
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", str(path)]) == 0
    stored = lt.connect(db.uri, artifacts=tmp_path / "artifacts").load("trainer", "dpo-yaml")
    assert stored.to_dict()["objective_args"]["loss_type"] == "ipo"
    capsys.readouterr()
    where = ["--db", db.uri, "--artifacts", str(tmp_path / "artifacts")]
    assert main(["show", "trainer", "dpo-yaml", *where]) == 0
    shown = capsys.readouterr().out  # the trainer, then its newest run: one rule for both
    assert "DPO, LoRA r=8" in shown and "prompt -> chosen over rejected" in shown
    assert "data       prompt -> chosen over rejected from table feedback" in shown
    assert re.search(r"REWARDS/MARGINS\s.*\sLOGPS/CHOSEN", shown) or re.search(
        r"LOGPS/CHOSEN\s.*\sREWARDS/MARGINS", shown
    )
    fill(db.uri, "thumbs", FEEDBACK)  # KTO on feedback, from the DPO model
    kto = {
        **config,
        "name": "kto-yaml",
        "init_from": "dpo-yaml",
        "objective_args": {"objective": "kto", "beta": 0.2},
        "data": {**KTO_FIELDS, "select": {"table": "thumbs"}},
    }
    path.write_text(yaml.safe_dump(kto))
    assert main(["fit", str(path)]) == 0
    assert main(["show", "trainer", "kto-yaml", *where]) == 0
    shown = capsys.readouterr().out
    assert "KTO, LoRA r=8" in shown and "prompt -> answer (liked: liked)" in shown
    assert "data       prompt -> answer (liked: liked) from table thumbs" in shown
    assert re.search(r"\sKL\s", shown) and "REWARDS/CHOSEN" in shown


# -- KTO: thumbs up/down on single answers ------------------------------------------------------
FEEDBACK = [
    {"id": i, "prompt": f"what color is item {i % 8}", "answer": COLORS[i % 4], "liked": 1}
    for i in range(8)
] + [
    {"id": i, "prompt": f"what color is item {i % 8}", "answer": "unsure", "liked": 0}
    for i in range(8, 12)
]
KTO_FIELDS = {"X": "prompt", "Y": "answer", "label": "liked"}


def test_kto_makes_liked_answers_likelier_than_disliked_ones(tiny: Path, tmp_path: Path) -> None:
    """8 liked and 4 disliked rows: the weights default from those counts (liked 4/8, so
    each kind weighs the same in all) and are recorded; at a fresh adapter the policy is the
    reference (KL 0, loss 0.5 x weight); after training every prompt's liked answer gained
    log-probability against the disliked one, through stock transformers."""
    db = _db(tmp_path, FEEDBACK)
    options = {**OPTIONS, "num_train_epochs": 6, "shuffle": False}
    trainer = lt.LLMTrainer("kto", model=tiny, objective="kto", **options)
    model = trainer.fit(db=db, select=lt.Table("feedback"), **KTO_FIELDS)
    assert model is not None
    (run,) = db.metadata.list_runs("trainer", "kto")
    recorded = run.info["config"]["objective_args"]
    assert (recorded["desirable_weight"], recorded["undesirable_weight"]) == (0.5, 1.0)
    assert db.load("trainer", "kto").to_dict()["objective_args"]["desirable_weight"] is None
    metrics = [m.values for m in db.metadata.get_metrics(run.run_id)]
    assert len(metrics) == 18
    assert metrics[0]["loss"] == pytest.approx(0.5 * 0.5, abs=1e-6)  # rows 0-3: all liked
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert "rewards/rejected" not in metrics[0] and "rewards/rejected" in metrics[2]
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model.export_merged(tmp_path / "merged")
    before, after = _margins(tiny, tokenizer), _margins(tmp_path / "merged", tokenizer)
    assert all(b < a for b, a in zip(before, after)), list(zip(before, after))
    assert sorted(c.key for c in db.lineage("model", "kto")) == sorted(list(range(12)) * 6)
    again = db.load("trainer", "kto").fit()
    assert again is not None and again.version == model.version + 1


def test_kto_reference_values_are_kept_for_each_pairing(
    tiny: Path, tmp_path: Path, references: list[int]
) -> None:
    """KTO's reference values (the answer, and the prompt with its neighbour's answer) are
    computed once: an epoch over the same micro-batches and a replay run no reference forward."""
    db = _db(tmp_path, FEEDBACK)
    options = {**OPTIONS, "num_train_epochs": 2, "shuffle": False}
    lt.LLMTrainer("kto-cached", model=tiny, objective="kto", **options).fit(
        db=db, select=lt.Table("feedback"), **KTO_FIELDS
    )
    assert references == [4, 4, 4]
    references.clear()
    db.load("trainer", "kto-cached").fit()
    first, replay = db.metadata.list_runs("trainer", "kto-cached")
    assert references == []
    losses = [
        [m.values["loss"] for m in db.metadata.get_metrics(r.run_id)] for r in (first, replay)
    ]
    assert losses[0] == losses[1]


def test_preferences_train_from_every_backend(any_uri: str, tiny: Path, tmp_path: Path) -> None:
    """DPO pairs from a join (SQL) or a collection, then KTO on liked/disliked rows whose
    label is the backend's own boolean (PostgreSQL's boolean, MariaDB's tinyint, SQLite's
    integer, a BSON bool), from the DPO model."""
    mongo = any_uri.startswith("mongo")
    answers = {row["id"]: row for row in ROWS}
    if mongo:
        fill(any_uri, "pairs", ROWS)
        pairs: Any = lt.Collection("pairs")
    else:  # what an application keeps: prompts, answers, and which one the user picked
        fill(any_uri, "prompts", [{"id": i, "text": r["prompt"]} for i, r in answers.items()])
        fill(any_uri, "answers", [{"id": i, "text": r["chosen"]} for i, r in answers.items()])
        fill(any_uri, "bad", [{"id": i, "text": r["rejected"]} for i, r in answers.items()])
        fill(any_uri, "picks", [{"id": i, "prompt_id": i, "a": i, "b": i} for i in answers])
        pairs = lt.sql(
            "SELECT f.id, p.text AS prompt, a.text AS chosen, b.text AS rejected FROM picks f "
            "JOIN prompts p ON p.id = f.prompt_id JOIN answers a ON a.id = f.a "
            "JOIN bad b ON b.id = f.b",
            key="id",
            source="picks",
        )
    fill(any_uri, "thumbs", [{**r, "liked": bool(r["liked"])} for r in FEEDBACK])
    db = lt.connect(any_uri, artifacts=tmp_path / "artifacts")
    options = {**OPTIONS, "max_steps": 2, "shuffle": False}
    lt.LLMTrainer("dpo-any", model=tiny, objective="dpo", **options).fit(
        db=db, select=pairs, **FIELDS
    )
    assert sorted(c.key for c in db.lineage("model", "dpo-any")) == list(range(8))
    thumbs = lt.Collection("thumbs") if mongo else lt.Table("thumbs")
    kto = lt.LLMTrainer("kto-any", model=tiny, objective="kto", init_from="dpo-any", **options)
    kto.fit(db=db, select=thumbs, **KTO_FIELDS)
    (run,) = db.metadata.list_runs("trainer", "kto-any")
    assert run.info["config"]["objective_args"]["desirable_weight"] == 0.5
    first = db.metadata.get_metrics(run.run_id)[0].values
    assert first["loss"] == pytest.approx(0.5 * 0.5, abs=1e-5)  # the DPO model: the reference
    trained = [c.key for c in db.lineage("model", "kto-any")]
    assert trained[:8] == list(range(8)) and sorted(trained[8:]) == list(range(8))


def test_kto_pairs_each_prompt_with_its_neighbours_answer_for_the_kl_estimate(tiny: Path) -> None:
    """The collate's second sequences (KTO's KL estimate, TRL's pairing): prompt i with the
    answer of the row before it in the micro-batch, packed with the answers themselves; as
    TRL's, prompt i's ids then that answer's ids (``"A:unsure"`` where only green's ``"Ġgreen"``
    took the space)."""
    from llmtrain.formatting import PackedCollator
    from llmtrain.objectives.preference import PairCollate

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    formatter = Formatter(tokenizer, TEMPLATE, max_length=32, x_field="prompt", y_field="answer")
    packer = PackedCollator(32, tokenizer.pad_token_id)
    collate = PairCollate(formatter, "answer", "liked", 0, "t", packer, feedback=True)
    rows = [(r["id"], {**r, "liked": bool(r["liked"])}) for r in FEEDBACK[6:10]]
    batch = collate(rows)
    assert batch["pairs"] == 4 and batch["liked"] == [True, True, False, False]
    ids, index = batch["input_ids"].flatten(), batch["sequence_index"].flatten()
    texts = [tokenizer.decode(ids[index == s], skip_special_tokens=True) for s in range(8)]
    seqs = [ids[index == s].tolist() for s in range(8)]
    labels = [batch["labels"].flatten()[index == s].tolist() for s in range(8)]
    trained = [[j for j, t in enumerate(s) if t != IGNORE_INDEX] for s in labels]  # no padding
    seqs = [s[: t[-1] + 1] for s, t in zip(seqs, trained)]
    starts = [t[0] for t in trained]
    answers = [row["answer"] for _, row in rows]
    for i, (_, row) in enumerate(rows):
        assert texts[i].endswith(f"{row['prompt']}\nA: {answers[i]}")
        assert texts[4 + i].endswith(answers[i - 1]) and row["prompt"] in texts[4 + i]
        before = (i - 1) % 4
        assert seqs[4 + i] == seqs[i][: starts[i]] + seqs[before][starts[before] :]


def test_kto_evaluates_margins_on_held_out_feedback_and_keeps_the_best(
    tiny: Path, tmp_path: Path
) -> None:
    db = _db(tmp_path, FEEDBACK)
    options = {**OPTIONS, "max_steps": 3, "eval_fraction": 0.25, "eval_steps": 1}
    options["save_best_by"] = "eval_rewards/margins"
    lt.LLMTrainer("kto-eval", model=tiny, objective="kto", **options).fit(
        db=db, select=lt.Table("feedback"), **KTO_FIELDS
    )
    (run,) = db.metadata.list_runs("trainer", "kto-eval")
    evaluated = [m.values for m in db.metadata.get_metrics(run.run_id) if "eval_loss" in m.values]
    assert len(evaluated) == 3 and all("eval_kl" in m for m in evaluated)
    best = db.metadata.get_run(run.run_id).info["best_checkpoint"]
    assert best["value"] == max(m["eval_rewards/margins"] for m in evaluated)


def test_qlora_kto_from_a_qlora_sft_model_starts_at_its_reference(
    tiny: Path, tmp_path: Path
) -> None:
    """bitsandbytes' 4-bit base under both adapters: the SFT model's, frozen as the reference,
    and the one trained from it (step 1 at 0.5 x weight: the policy is the reference)."""
    db = _db(tmp_path, FEEDBACK)
    options = {**OPTIONS, "max_steps": 2, "shuffle": False, "bits": 4, "qlora": True}
    lt.LLMTrainer("sft-4bit", model=tiny, **options).fit(
        db=db, select=lt.Table("feedback"), X="prompt", Y="answer"
    )
    kto = lt.LLMTrainer("kto-4bit", model=tiny, objective="kto", init_from="sft-4bit", **options)
    assert kto.fit(db=db, select=lt.Table("feedback"), **KTO_FIELDS) is not None
    (run,) = db.metadata.list_runs("trainer", "kto-4bit")
    losses = [m.values["loss"] for m in db.metadata.get_metrics(run.run_id)]
    assert losses[0] == pytest.approx(0.5 * 0.5, abs=1e-5) and losses[1] != losses[0]


def test_label_counts_are_the_snapshots_valid_labels(any_uri: str, tmp_path: Path) -> None:
    """KTO's default weights count the snapshot's rows only (not one added since) and only
    values that are labels (not 2), as the reader would take them."""
    from llmtrain.data.snapshot import take_snapshot
    from llmtrain.objectives.kto import label_counts

    fill(any_uri, "thumbs", [{"id": i, "liked": int(i % 3 != 0)} for i in range(30)])
    fill(any_uri, "extra", [{"id": 30, "liked": 2}, {"id": 31, "liked": 1}])
    mongo = any_uri.startswith("mongo")
    query = lt.Collection("thumbs") if mongo else lt.Table("thumbs")
    db = lt.connect(any_uri, artifacts=tmp_path / "artifacts")
    copy = "INSERT INTO thumbs (id, liked) SELECT id, liked FROM extra WHERE id = {}"
    if mongo:
        from llmtrain.db.engines import mongo_database

        database = mongo_database(any_uri)
        database["thumbs"].insert_one({"_id": 30, "liked": 2})
    else:
        import sqlalchemy as sa

        from llmtrain.db.engines import sql_engine

        with sql_engine(any_uri).begin() as conn:
            conn.execute(sa.text(copy.format(30)))
    snapshot = take_snapshot(db, query)
    if mongo:
        database["thumbs"].insert_one({"_id": 31, "liked": 1})
    else:
        with sql_engine(any_uri).begin() as conn:
            conn.execute(sa.text(copy.format(31)))
    assert label_counts(db, query, snapshot.train, "liked") == (20, 10)


def test_a_pair_whose_long_answer_cuts_the_prompt_compares_both_answers_after_that_prompt(
    tiny: Path,
) -> None:
    """max_length cuts a long answer's prompt from the left: its short partner is given the same
    shorter prompt, so the two log-probs compare answers to one context (and fit max_length)."""
    from llmtrain.formatting import IGNORE_INDEX
    from llmtrain.objectives.preference import PairCollate

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    formatter = Formatter(tokenizer, TEMPLATE, max_length=40, x_field="prompt", y_field="chosen")
    collate = PairCollate(formatter, "chosen", "rejected", tokenizer.pad_token_id, "t", None)
    long = "it is raining and windy with a lot of clouds everywhere " * 2
    prompt = "Please describe the weather today in detail, in full sentences."
    rows = [(1, {"prompt": prompt, "chosen": "Sunny.", "rejected": long})]
    rows.append((2, {"prompt": prompt, "chosen": long, "rejected": "Sunny."}))
    batch = collate(rows)
    ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    for a, b in ((0, 2), (1, 3)):  # each row's chosen, then its rejected sequence
        heads = [next(i for i, t in enumerate(labels[s]) if t != IGNORE_INDEX) for s in (a, b)]
        assert heads[0] == heads[1] and ids[a][: heads[0]] == ids[b][: heads[1]]
        assert ids[a][0] == tokenizer.bos_token_id  # BOS kept, the prompt cut from the left
        assert heads[0] < len(formatter.format({"prompt": prompt, "chosen": "Sunny."}).input_ids)
    assert batch["input_ids"].shape[1] <= 40


def test_conversational_pairs_train_as_the_same_rows_in_text(tiny: Path, tmp_path: Path) -> None:
    """TRL's conversational preference rows: the prompt as its messages (a JSON column), each
    answer one assistant message. Through the chat template they are the same sequences as the
    prompt and answers in text: the same losses, step by step; a prompt of other shapes is a
    bad row that names its field."""
    import json

    def message(role: str, text: str) -> str:
        return json.dumps([{"role": role, "content": text}])

    chat = [
        {**r, "prompt": message("user", r["prompt"]), "chosen": message("assistant", r["chosen"])}
        | {"rejected": message("assistant", r["rejected"])}
        for r in ROWS
    ]
    db = _db(tmp_path)
    fill(f"sqlite:///{tmp_path / 'data.db'}", "chat", chat)
    options = {**OPTIONS, "max_steps": 2, "prompt_template": None, "chat_template": True}
    losses = []
    for table in ("feedback", "chat"):
        lt.LLMTrainer(table, model=tiny, objective="dpo", **options).fit(
            db=db, select=lt.Table(table), **FIELDS
        )
        (run,) = db.metadata.list_runs("trainer", table)
        losses.append([m.values["loss"] for m in db.metadata.get_metrics(run.run_id)])
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    bad = [{**chat[0], "prompt": json.dumps([{"role": "nobody", "content": "x"}])}]
    fill(f"sqlite:///{tmp_path / 'data.db'}", "bad", bad)
    with pytest.raises(BadRowError, match="'prompt' is not a prompt's messages"):
        lt.LLMTrainer("bad", model=tiny, objective="dpo", **options).fit(
            db=db, select=lt.Table("bad"), **FIELDS
        )
