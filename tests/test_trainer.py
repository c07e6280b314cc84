"""LLMTrainer end to end on a SQLite file with a tiny local model: QLoRA/DoRA layers, learning,
exact resume, replay, stock loading of the adapter and the merged model, config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill
from hooks import KeyTrace, crash_after_checkpoint
from safetensors.torch import load_file

import llmtrain as lt
from llmtrain.errors import ConfigError, DataChangedError
from llmtrain.testing import tiny_model

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture
def db(tmp_path: Path) -> Any:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(
        uri,
        "docs",
        [
            {
                "id": i,
                "instruction": f"What is color number {i % 8}?",
                "output": COLORS[i % 8],
                "lang": "en" if i < 48 else "fr",
            }
            for i in range(64)
        ],
    )
    return lt.connect(uri, artifacts=tmp_path / "artifacts")


def _plan(db: Any, model: Any) -> Any:
    """The plan of the run that made ``model``, as a launched worker reads it."""
    from llmtrain.training.plan import RunPlan

    return RunPlan.from_record(db.metadata.get_run(model.record.run_id))


def _trainer(tiny: Path, name: str = "sft", **kwargs: Any) -> lt.LLMTrainer:
    options: dict[str, Any] = {
        "max_steps": 6,
        "batch_size": 4,
        "learning_rate": 1e-2,
        "lora_r": 8,
        "progress_bar": False,
        "logging_steps": 1,
    }
    options.update(kwargs)
    return lt.LLMTrainer(name, model=tiny, prompt_template=TEMPLATE, **options)


def _fit(trainer: lt.LLMTrainer, db: Any, **kwargs: Any) -> Any:
    return trainer.fit(
        X="instruction",
        Y="output",
        db=db,
        select=lt.Table("docs").where("lang = :l", l="en"),
        **kwargs,
    )


def _adapter(db: Any, model: Any, tmp_path: Path) -> dict[str, torch.Tensor]:
    folder = tmp_path / f"adapter-{model.identifier}-{model.version}"
    db.artifacts.get_dir(model.record.adapter, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


def test_fit_records_trainer_run_metrics_and_model(tiny: Path, db: Any) -> None:
    model = _fit(_trainer(tiny), db)
    assert db.show("trainer") == ["sft"] and db.show("model") == ["sft"]
    (run,) = db.metadata.list_runs("trainer", "sft")
    assert run.status == "completed" and run.info["steps"] == 6
    assert run.info["query"] == lt.Table("docs").where("lang = :l", l="en").to_dict()
    assert run.info["X"] == "instruction" and "torch" in run.info["versions"]
    metrics = db.metadata.get_metrics(run.run_id)
    assert [m.step for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "tokens", "tokens_per_s", "grad_norm"} <= set(metrics[0].values)
    assert model.record.run_id == run.run_id
    assert db.load("model", "sft").record == model.record


def test_qlora_4bit_and_dora_use_real_bitsandbytes_and_peft_layers(tiny: Path, db: Any) -> None:
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from llmtrain.training.run import FitRun
    from llmtrain.training.strategies import make_strategy

    trainer = _trainer(tiny, "qdora", bits=4, qlora=True, use_dora=True, max_steps=2)
    model = _fit(trainer, db)
    run = FitRun(_plan(db, model), db, make_strategy("single"))
    run.setup()
    try:
        layer = run.model.base_model.model.model.layers[0].self_attn.q_proj
        assert isinstance(layer, LoraLinear4bit)
        assert isinstance(layer.base_layer, bnb.nn.Linear4bit)
        assert layer.base_layer.weight.quant_state.quant_type == "nf4"
        assert "default" in layer.lora_magnitude_vector  # DoRA's magnitude
    finally:
        run.cleanup()
    weights = _adapter(db, model, Path(db.artifacts.root).parent)
    assert any("lora_magnitude_vector" in k for k in weights)


def test_tiny_model_learns_the_table(tiny: Path, db: Any) -> None:
    trainer = _trainer(
        tiny,
        "learn",
        max_steps=100,
        batch_size=8,
        lora_r=16,
        learning_rate=2e-2,
        lora_dropout=0.0,
        logging_steps=10,
    )
    model = _fit(trainer, db)
    history = model.record.history
    first, last = history[0]["loss"], history[-1]["loss"]
    assert last < first * 0.2, (first, last)
    answers = model.generate([f"What is color number {i}?" for i in range(8)], max_new_tokens=4)
    assert sum(a.strip() == c for a, c in zip(answers, COLORS)) >= 7, answers


def test_resume_after_interruption_gives_the_same_adapter(
    tiny: Path, db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"max_steps": 10, "save_steps": 3, "lora_dropout": 0.1, "batch_size": 4}
    reference = _fit(_trainer(tiny, "straight", **options), db)

    undo = crash_after_checkpoint(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        _fit(_trainer(tiny, "crashy", **options), db)
    (failed,) = db.metadata.list_runs("trainer", "crashy")
    assert failed.status == "interrupted" and "simulated crash" in failed.error
    undo()

    resumed = _fit(_trainer(tiny, "crashy", **options), db, resume=True)
    (run,) = db.metadata.list_runs("trainer", "crashy")
    assert run.status == "completed" and resumed.record.run_id == failed.run_id
    a, b = _adapter(db, reference, tmp_path), _adapter(db, resumed, tmp_path)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    steps = [m.step for m in db.metadata.get_metrics(run.run_id)]
    assert steps == sorted(steps) and steps[-1] == 10


def test_replay_loads_the_same_trainer_and_fits_the_same_adapter(tiny: Path, db: Any) -> None:
    trainer = _trainer(tiny, "replay", max_steps=2)
    first = _fit(trainer, db)
    again = db.load("trainer", "replay")
    assert again == trainer and again.config.fit.X == "instruction"
    assert again.config.fit.select == trainer.config.fit.select
    replayed = again.fit()
    runs = db.metadata.list_runs("trainer", "replay")
    assert [r.status for r in runs] == ["completed", "completed"]
    assert runs[0].info["data_fingerprint"] == runs[1].info["data_fingerprint"]
    assert db.show("trainer", "replay") == [0]  # the same recipe is not stored twice
    # bit-equal tensors and the same adapter_config.json: the same content id
    assert replayed.record.adapter == first.record.adapter


def test_config_values_serialise_the_same_however_they_were_given(tmp_path: Path) -> None:
    """lora_alpha=16 by default, 16 or 16.0 explicitly, read back from a record or a YAML
    file: the same stored recipe (a float field never keeps an int)."""
    from llmtrain.config.file import load_job

    given = [
        lt.LLMTrainer("same", model="m", prompt_template=TEMPLATE),
        lt.LLMTrainer("same", model="m", prompt_template=TEMPLATE, lora_alpha=16),
        lt.LLMTrainer("same", model="m", prompt_template=TEMPLATE, lora_alpha=16.0),
        lt.LLMTrainer("same", model="m", prompt_template=TEMPLATE, warmup_ratio=0),
    ]
    given.append(lt.LLMTrainer.from_dict(given[0].to_dict()))
    (tmp_path / "c.yaml").write_text(
        "name: same\nmodel_args: {model_name_or_path: m}\nprompt_template: 'Q {X} A {Y}'\n"
        "lora_args: {lora_alpha: 16}\ndata: {X: x, Y: y, select: {table: t}}\ndb: sqlite:///x.db\n"
    )
    job = load_job(tmp_path / "c.yaml")
    from_yaml = lt.LLMTrainer(job.config.name, **job.options).to_dict()
    texts = {json.dumps(t.to_dict(), sort_keys=True) for t in given}
    values = {json.dumps(t.config.model_dump(), sort_keys=True) for t in given}  # in memory
    assert len(texts) == 1 and len(values) == 1
    assert from_yaml["lora_args"] == given[0].to_dict()["lora_args"]
    assert repr(given[0].to_dict()["lora_args"]["lora_alpha"]) == "16.0"


def test_replay_refuses_changed_rows_unless_allowed(tiny: Path, db: Any) -> None:
    _fit(_trainer(tiny, "drift", max_steps=1), db)
    import sqlalchemy as sa

    from llmtrain.db.engines import sql_engine

    with sql_engine(db.secret_uri()).begin() as conn:
        conn.execute(sa.text("DELETE FROM docs WHERE id = 5"))
    again = db.load("trainer", "drift")
    with pytest.raises(DataChangedError, match="changed since trainer 'drift'"):
        again.fit()
    again.fit(allow_changed_data=True)


def test_saved_adapter_and_merged_model_load_with_stock_libraries(
    tiny: Path, db: Any, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _fit(_trainer(tiny, "export", max_steps=4), db)
    ours, tokenizer = model.load(device="cpu")
    ids = tokenizer(["What is color number 2?"], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = ours(input_ids=ids).logits

    adapter_dir = tmp_path / "adapter"
    db.artifacts.get_dir(model.record.adapter, adapter_dir)
    assert (adapter_dir / "adapter_config.json").is_file()
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(stock.eval()(input_ids=ids).logits, expected)
        base = AutoModelForCausalLM.from_pretrained(tiny)(input_ids=ids).logits
    assert not torch.allclose(base, expected)  # the adapter does change the model

    merged_dir = tmp_path / "merged"
    model.export_merged(merged_dir)
    assert any(p.suffix == ".safetensors" for p in merged_dir.iterdir())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learning_rate": 0}, "learning_rate"),
        ({"lora_r": 0}, "lora_args.r"),
        ({"bits": 3}, "model_args.bits"),
        ({"warmup": 3}, "unknown option 'warmup'"),
        ({"max_steps": "many"}, "max_steps"),
        ({"lora_args": None, "bits": 4}, "only an adapter can train"),
    ],
)
def test_bad_configs_are_rejected_naming_the_field(
    tiny: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        lt.LLMTrainer("bad", model=tiny, prompt_template=TEMPLATE, **kwargs)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("Q: {X} {X}", r"\{X\} exactly once"),  # ({X} alone is a document template)
        ("Q: {X} {Z} A: {Y}", "Z"),
        ("Q: {X} A: {Y} end", "after"),
    ],
)
def test_bad_templates_are_rejected(tiny: Path, template: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        lt.LLMTrainer("bad", model=tiny, prompt_template=template)


def test_unknown_target_module_lists_the_model_layers(tiny: Path, db: Any) -> None:
    trainer = _trainer(tiny, "targets", target_modules=["query"])
    with pytest.raises(ConfigError, match=r"match no linear layer.*q_proj"):
        _fit(trainer, db)
    # found before anything is recorded: no trainer version, no failed run
    assert db.metadata.list_runs("trainer", "targets") == []
    assert "targets" not in db.show("trainer")


def test_packing_and_held_out_eval(tiny: Path, db: Any) -> None:

    from llmtrain.data import held_out

    trace = KeyTrace()
    trainer = _trainer(
        tiny, "packed", packing=True, eval_fraction=0.25, eval_steps=2, max_steps=4, batch_size=8
    )
    _fit(trainer, db, callbacks=[trace])
    (run,) = db.metadata.list_runs("trainer", "packed")
    evals = [m for m in db.metadata.get_metrics(run.run_id) if "eval_loss" in m.values]
    assert [m.step for m in evals] == [2, 4]
    assert all(0 < m.values["eval_loss"] < 20 for m in evals)
    trained = trace.keys
    held = {k for k in range(48) if held_out(k, 0.25)}
    assert held and trained and not held & {int(k.split(":")[1]) for k in trained}


def test_eval_select_is_recorded_and_scored(tiny: Path, db: Any) -> None:
    trainer = _trainer(tiny, "evalsel", max_steps=2)
    trainer.fit(
        X="instruction",
        Y="output",
        db=db,
        select=lt.Table("docs").where("lang = :l", l="en"),
        eval_select=lt.Table("docs").where("lang = :l", l="fr"),
    )
    (run,) = db.metadata.list_runs("trainer", "evalsel")
    last = db.metadata.get_metrics(run.run_id)[-1]
    assert "eval_loss" in last.values
    assert db.load("trainer", "evalsel").config.fit.eval_select["params"] == {"l": "fr"}


def test_empty_selection_is_a_clear_error(tiny: Path, db: Any) -> None:
    with pytest.raises(lt.DataError, match="selects 0 row"):
        _trainer(tiny, "empty").fit(
            X="instruction", Y="output", db=db, select=lt.Table("docs").where("lang = :l", l="de")
        )


def test_max_steps_beyond_usable_rows_stops_instead_of_spinning(tiny: Path, db: Any) -> None:
    rows = lt.Table("docs").where("id = :i", i=1)
    trainer = _trainer(tiny, "skipall", max_steps=50, on_bad_row="skip")
    import sqlalchemy as sa

    from llmtrain.db.engines import sql_engine

    with sql_engine(db.secret_uri()).begin() as conn:
        conn.execute(sa.text("UPDATE docs SET output = NULL WHERE id = 1"))
    with pytest.raises(lt.DataError, match=r"no example was trained: 1 row\(s\) skipped"):
        trainer.fit(X="instruction", Y="output", db=db, select=rows)
    (run,) = db.metadata.list_runs("trainer", "skipall")  # it stopped, and stored no model
    assert run.status == "failed" and run.info["steps"] == 1  # after its first epoch's one step
    assert "skipall" not in db.show("model")


def test_8bit_base_with_paged_8bit_adamw(tiny: Path, db: Any) -> None:
    import bitsandbytes as bnb

    from llmtrain.training.run import FitRun
    from llmtrain.training.strategies import make_strategy

    trainer = _trainer(tiny, "eight", bits=8, qlora=True, optim="paged_adamw_8bit", max_steps=2)
    model = _fit(trainer, db)
    assert len(model.record.history) == 2
    run = FitRun(_plan(db, model), db, make_strategy("single"))
    run.setup()
    try:
        layer = run.model.base_model.model.model.layers[0].mlp.up_proj
        assert isinstance(layer.base_layer, bnb.nn.Linear8bitLt)
        assert isinstance(run.optimizer, bnb.optim.PagedAdamW8bit)
    finally:
        run.cleanup()


def test_dataloader_workers_do_not_change_what_is_trained(tiny: Path, db: Any) -> None:
    options = {"max_steps": 5, "batch_size": 4, "lora_dropout": 0.0}
    alone = _fit(_trainer(tiny, "workers0", **options), db)
    workers = _fit(_trainer(tiny, "workers2", dataloader_num_workers=2, **options), db)
    assert [h["loss"] for h in alone.record.history] == [h["loss"] for h in workers.record.history]


def test_full_finetune_with_chat_template_checkpointing_and_retention(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmtrain.training.checkpoint import Checkpointer

    saved: list[str] = []
    original = Checkpointer.save

    def remember(self: Any, *args: Any) -> Any:
        record = original(self, *args)
        saved.append(record.artifact_id)
        return record

    monkeypatch.setattr(Checkpointer, "save", remember)
    trainer = lt.LLMTrainer(
        "full",
        model=tiny,
        lora_args=None,
        chat_template=True,
        gradient_checkpointing=True,
        max_steps=3,
        save_steps=1,
        save_total_limit=1,
        batch_size=4,
        learning_rate=1e-3,
        progress_bar=False,
        lr_scheduler_type="cosine",
    )
    model = _fit(trainer, db)
    assert model.record.full_model and model.record.chat_template
    (run,) = db.metadata.list_runs("trainer", "full")
    checkpoints = db.metadata.list_checkpoints(run.run_id)
    assert [c.step for c in checkpoints] == [3]  # steps 1 and 2 were pruned...
    assert len(saved) == 3 and [db.artifacts.exists(a) for a in saved] == [False, False, True]
    loaded, _ = db.load("model", "full").load(device="cpu")
    assert not hasattr(loaded, "peft_config")  # all weights, no adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny)
    changed = [n for n, p in loaded.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert changed  # full fine-tuning moved the base weights themselves
    answer = db.load("model", "full").generate("What is color number 1?", max_new_tokens=3)
    assert isinstance(answer, str)


# -- precision ----------------------------------------------------------------------------------
def test_fp16_trains_with_a_loss_scaler_whose_state_survives_a_resume(
    tiny: Path, db: Any, tmp_path: Path
) -> None:
    """fp16 autocast (honoured on the CPU too) with the GradScaler: the adapter learns
    (LoRA's B starts at zero), and resuming restores the scaler's state from the checkpoint."""
    from llmtrain.training.callbacks import Callback
    from llmtrain.training.plan import RunPlan
    from llmtrain.training.run import FitRun
    from llmtrain.training.strategies import make_strategy

    class ScalerAtEnd(Callback):
        def on_train_end(self, run: Any) -> None:
            self.state = run.strategy.scaler.state_dict()
            self.dtype = run.precision.autocast_dtype

    seen = ScalerAtEnd()
    trainer = _trainer(tiny, "fp16", mixed_precision="fp16", max_steps=4, save_steps=2)
    model = _fit(trainer, db, callbacks=[seen])
    assert seen.dtype == torch.float16 and seen.state["_growth_tracker"] > 0
    (run,) = db.metadata.list_runs("trainer", "fp16")
    assert run.status == "completed" and all(math.isfinite(h["loss"]) for h in model.record.history)
    weights = _adapter(db, model, tmp_path)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in weights.items())

    (latest, *_) = reversed(db.metadata.list_checkpoints(run.run_id))
    resumed = FitRun(RunPlan.from_record(run, latest), db, make_strategy("single"))
    resumed.setup()
    try:
        assert resumed.step == 4 and resumed.strategy.scaler.state_dict() == seen.state
    finally:
        resumed.cleanup()


def test_gradient_checkpointing_is_switched_on_in_one_place_for_adapter_and_full(
    tiny: Path,
) -> None:
    from llmtrain.config.args import LoraArguments, ModelArguments
    from llmtrain.training.modeling import load_model, prepare_for_training

    args = ModelArguments(model_name_or_path=str(tiny))
    for lora in (LoraArguments(r=4), None):
        model = prepare_for_training(
            load_model(args, torch.device("cpu")),
            lora,
            quantized=False,
            gradient_checkpointing=True,
        )
        assert model.is_gradient_checkpointing
        loss = model(
            input_ids=torch.tensor([[1, 2, 3, 4]]),
            labels=torch.tensor([[1, 2, 3, 4]]),
            use_cache=False,
        ).loss
        loss.backward()  # the adapter gets gradients through the checkpointed layers
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None for p in trained)
        plain = prepare_for_training(
            load_model(args, torch.device("cpu")),
            lora,
            quantized=False,
            gradient_checkpointing=False,
        )
        assert not plain.is_gradient_checkpointing


def test_steps_and_schedule_count_training_rows_only(tiny: Path, db: Any) -> None:
    from llmtrain.data import held_out

    trainer = _trainer(
        tiny,
        "exact",
        max_steps=-1,
        num_train_epochs=2,
        batch_size=4,
        eval_fraction=0.25,
        lr_scheduler_type="linear",
    )
    _fit(trainer, db)
    steps = 2 * -(-sum(not held_out(k, 0.25) for k in range(48)) // 4)
    (run,) = db.metadata.list_runs("trainer", "exact")
    assert run.info["steps"] == steps < 2 * 48 // 4
    lrs = [m for m in db.metadata.get_metrics(run.run_id) if "lr" in m.values]
    # the schedule's total is the real step count; each step logs the rate it trained with
    assert [m.step for m in lrs] == list(range(1, steps + 1))
    assert [m.values["lr"] for m in lrs] == pytest.approx(
        [1e-2 * (steps - s) / steps for s in range(steps)], rel=1e-6
    )


@pytest.mark.parametrize("eval_fraction", [0.0, 0.25])
def test_a_fit_snapshots_its_selection_once_and_a_resume_not_at_all(
    tiny: Path, db: Any, eval_fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmtrain.data.cached
    import llmtrain.running.register
    from llmtrain.data import take_snapshot

    snapshots: list[str] = []

    def counting(db: Any, query: Any, **kwargs: Any) -> Any:
        snapshots.append(query.source)
        return take_snapshot(db, query, **kwargs)

    for module in (llmtrain.data.cached, llmtrain.running.register):
        monkeypatch.setattr(module, "take_snapshot", counting)
    options: dict[str, Any] = {"max_steps": 4, "save_steps": 2, "eval_fraction": eval_fraction}
    if eval_fraction:
        options["eval_steps"] = 2
    _fit(_trainer(tiny, "onescan", **options), db)
    assert snapshots == ["table docs"]  # the training rows and the held-out rows: one pass
    (run,) = db.metadata.list_runs("trainer", "onescan")
    assert (
        run.info["snapshot"]["train"]["count"]
        + (run.info["snapshot"]["held"] or {"count": 0})["count"]
        == 48
    )
    _fit(_trainer(tiny, "onescan", **options), db, resume=True)
    assert snapshots == ["table docs"]  # the resume read the run's snapshot from its record


def test_every_evaluation_reads_the_same_held_out_rows(tiny: Path, db: Any) -> None:
    # a learning rate too small to move the loss: evaluations differ only if their rows do
    trainer = _trainer(
        tiny,
        "sameeval",
        eval_fraction=0.25,
        eval_steps=1,
        max_steps=2,
        max_eval_rows=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-12,
    )
    _fit(trainer, db)
    (run,) = db.metadata.list_runs("trainer", "sameeval")
    losses = [
        m.values["eval_loss"]
        for m in db.metadata.get_metrics(run.run_id)
        if "eval_loss" in m.values
    ]
    assert len(losses) == 2
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)


def test_token_budget_packs_each_steps_rows_and_resumes_into_the_same_batches(
    tiny: Path, db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_tokens_per_batch: a step's 8 rows in micro-batches of at most 2 rows of 64 tokens;
    each row once per epoch; the LR falls to 1/6 of its peak on the last step; a resume (with other
    num_workers) puts the same rows in the same micro-batches and gives the same adapter."""
    from llmtrain.training import run as run_module

    options = {
        "max_steps": -1,
        "num_train_epochs": 1,
        "gradient_accumulation_steps": 2,  # 4 x 2 = 8 rows a step: 6 steps an epoch
        "packing": True,
        "max_length": 64,
        "max_tokens_per_batch": 128,
        "save_steps": 3,
        "lr_scheduler_type": "linear",
        "lora_dropout": 0.1,
    }
    seen: dict[str, list[tuple[int, list[list[str]], list[tuple[int, int]]]]] = {}
    train_step = run_module.FitRun._train_step

    def traced(self: Any, group: list[dict[str, Any]], *args: Any) -> float:
        seen.setdefault(self.plan.identifier, []).append(
            (
                self.step + 1,
                [b["keys"] for b in group],
                [tuple(b["input_ids"].shape) for b in group],
            )
        )
        return train_step(self, group, *args)

    monkeypatch.setattr(run_module.FitRun, "_train_step", traced)
    reference = _fit(_trainer(tiny, "budget", **options), db)
    ref = seen["budget"]
    assert [step for step, _, _ in ref] == list(range(1, 7))
    for _, keys, shapes in ref:
        assert sum(map(len, keys)) == 8
        assert all(rows * width <= 128 and rows <= 2 and width <= 64 for rows, width in shapes)
    assert max(len(keys) for _, keys, _ in ref) > 1  # several micro-batches in a step
    assert max(rows for _, _, shapes in ref for rows, _ in shapes) == 2  # and rows packed
    keys = [k for _, batches, _ in ref for b in batches for k in b]
    assert sorted(keys) == sorted(f"int:{i}" for i in range(48))  # each row once an epoch
    (run,) = db.metadata.list_runs("trainer", "budget")
    lrs = [m for m in db.metadata.get_metrics(run.run_id) if "lr" in m.values]
    assert [m.values["lr"] for m in lrs] == pytest.approx([1e-2 * (6 - s) / 6 for s in range(6)])

    undo = crash_after_checkpoint(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):  # two DataLoader workers this time
        _fit(_trainer(tiny, "budget-crash", dataloader_num_workers=2, **options), db)
    undo()
    assert seen.pop("budget-crash") == ref[:3]
    resumed = _fit(
        _trainer(tiny, "budget-crash", dataloader_num_workers=2, **options), db, resume=True
    )
    assert seen["budget-crash"] == ref[3:]
    a, b = _adapter(db, reference, tmp_path), _adapter(db, resumed, tmp_path)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


@pytest.mark.parametrize("modules", [["lm_head"], ["embed_tokens", "lm_head"]])
def test_modules_to_save_train_store_load_in_stock_peft_and_resume(
    tiny: Path, db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: list[str]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    options = {"max_steps": 4, "save_steps": 2, "modules_to_save": modules}
    straight = _fit(_trainer(tiny, "heads", **options), db)
    stored = _adapter(db, straight, tmp_path)
    assert {k.split(".")[-2] for k in stored} >= set(modules) | {"lora_A", "lora_B"}
    ours, tokenizer = straight.load(device="cpu")
    ids = tokenizer(["What is color number 2?"], return_tensors="pt").input_ids
    folder = tmp_path / "stock"
    db.artifacts.get_dir(straight.record.adapter, folder)
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), folder)
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
        torch.testing.assert_close(stock.eval()(input_ids=ids).logits, expected)
    base = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    for key, value in stored.items():  # the saved modules trained, as the LoRA layers did
        if "lora_" not in key:
            assert not torch.equal(value, base[key.removeprefix("base_model.model.")]), key
    undo = crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        _fit(_trainer(tiny, "heads-crash", **options), db)
    undo()
    resumed = _adapter(
        db, _fit(_trainer(tiny, "heads-crash", **options), db, resume=True), tmp_path
    )
    assert resumed.keys() == stored.keys()
    for key in stored:
        torch.testing.assert_close(resumed[key], stored[key], rtol=0, atol=0)
