"""One configuration schema: TrainerConfig and its argument models are the single source.

Promises: LLMTrainer's flat keywords, the YAML file's options, the CLI's overrides and the
keyword reference are derived from the models; every field is documented; a combination that
cannot work is refused when the trainer is built (from keywords, a stored record or a YAML
file), every problem in one ConfigError naming its fields; and fit(allow_changed_data=) never
changes the stored recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import fill

import llmtrain as lt
from llmtrain.config.args import TrainerConfig, quantization_problems
from llmtrain.config.file import FitFile, build_job, check_path
from llmtrain.config.spec import FitSpec
from llmtrain.errors import ConfigError, DataChangedError

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "Q: {X}\nA: {Y}"
ALIASES = {
    "model": ("model_args", "model_name_or_path"),
    "lora_r": ("lora_args", "r"),
    "batch_size": ("training_args", "per_device_train_batch_size"),
    "epochs": ("training_args", "num_train_epochs"),
}


def _trainer(**options: Any) -> lt.LLMTrainer:
    return lt.LLMTrainer("cfg", **{"model": "some/model", "prompt_template": TEMPLATE, **options})


# -- derived from the schema -----------------------------------------------------------------
def test_every_field_of_every_model_has_a_description() -> None:
    models = [TrainerConfig, FitSpec, *TrainerConfig.sections().values()]
    missing = [
        f"{m.__name__}.{name}"
        for m in models
        for name, field in m.model_fields.items()
        if not field.description
    ]
    assert missing == []


@pytest.mark.parametrize(
    "section",
    [
        lt.TrainingArguments(learning_rate=1e-3, max_steps=7),
        lt.LoraArguments(r=4, lora_dropout=0.0),
        lt.ModelArguments(model_name_or_path="m", bits=4),
        lt.DataArguments(max_length=64, packing=True),
        lt.DeepspeedConfig(stage=3),
        lt.FSDPConfig(),
        lt.RayConfig(num_workers=3),
    ],
    ids=lambda section: type(section).__name__,
)
def test_each_section_round_trips_through_its_dict(section: Any) -> None:
    cls = type(section)
    assert cls.from_dict(section.to_dict()) == section
    with pytest.raises(ConfigError, match=f"{cls.__name__}.nope"):
        cls.from_dict({**section.to_dict(), "nope": 1})


def test_flat_keywords_are_the_fields_of_the_flat_sections_and_their_aliases() -> None:
    flat = TrainerConfig.flat_keywords()
    for alias, target in ALIASES.items():
        assert flat[alias] == target
    for section in ("model_args", "lora_args", "training_args", "data_args"):
        for name in TrainerConfig.sections()[section].model_fields:
            assert flat[name] == (section, name)
    assert not {"stage", "kind", "cpu_offload"} & set(flat)  # strategy sections are not flat
    t = _trainer(lora_r=4, batch_size=2, epochs=3, packing=True, bits=8, seed=7)
    c = t.config
    assert (
        c.lora_args.r,
        c.training_args.per_device_train_batch_size,
        c.training_args.num_train_epochs,
        c.data_args.packing,
        c.model_args.bits,
        c.training_args.seed,
    ) == (4, 2, 3, True, 8, 7)
    assert t == _trainer(
        lora_args={"r": 4},
        model_args={"model_name_or_path": "some/model", "bits": 8},
        training_args=lt.TrainingArguments(
            per_device_train_batch_size=2, num_train_epochs=3, seed=7
        ),
        data_args={"packing": True},
    )


def test_flat_keyword_mistakes_are_named() -> None:
    with pytest.raises(ConfigError, match=r"lora_r= is given twice \(also in lora_args\)"):
        _trainer(lora_r=4, lora_args={"r": 8})
    _trainer(lora_r=4, lora_args={"r": 4})  # the same value twice is not a contradiction
    with pytest.raises(ConfigError, match="lora_args=None asks for full fine-tuning"):
        _trainer(lora_args=None, use_dora=True)
    with pytest.raises(ConfigError, match="cannot be combined with lora_args=None"):
        _trainer(lora_args=None, qlora=True)
    with pytest.raises(ConfigError, match="unknown option 'stage'"):
        _trainer(stage=3)
    with pytest.raises(ConfigError, match="needs model="):
        lt.LLMTrainer("cfg", prompt_template=TEMPLATE)
    assert _trainer(qlora=True).config.model_args.bits == 4
    assert _trainer(training_args=None).config.training_args == lt.TrainingArguments()


def test_the_docstring_and_readme_name_every_flat_keyword() -> None:
    doc = lt.LLMTrainer.__doc__ or ""
    for keyword in [*TrainerConfig.flat_keywords(), *TrainerConfig.options(), "qlora"]:
        assert f"``{keyword}=``" in doc, keyword
    readme = (ROOT / "README.md").read_text()
    for keyword in [*ALIASES, "qlora"]:
        assert f"`{keyword}=`" in readme, keyword


def test_file_options_and_overrides_come_from_the_schema() -> None:
    assert set(FitFile.model_fields) == {
        "name",
        "db",
        "artifacts",
        "data",
        *TrainerConfig.options(),
    }
    for section, model in TrainerConfig.sections().items():
        check_path(section)
        for name in model.model_fields:
            check_path(f"{section}.{name}")
    for scalar in ("prompt_template", "name", "db", "artifacts"):
        check_path(scalar)
    with pytest.raises(ConfigError, match=r"Launcher has no 'nodes'.*num_nodes"):
        check_path("launcher.nodes")


# -- cross-field rules -----------------------------------------------------------------------
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"chat_template": True}, r"prompt_template and data_args.chat_template=True: give one"),
    ({"prompt_template": "Q: {Y} {X}"}, r"prompt_template: .*\{X\} follows it"),
    ({"lora_args": None, "bits": 4}, r"model_args.bits=4 with lora_args=None.*only an adapter"),
    ({"deepspeed_config": {}, "fsdp_config": {}}, "deepspeed_config and fsdp_config"),
    (
        {"bits": 4, "deepspeed_config": {"stage": 3}},
        r"model_args.bits=4 with deepspeed_config stage 3.*use deepspeed_config stage 1 or 2",
    ),
    (
        {"bits": 4, "deepspeed_config": {"raw": {"zero_optimization": {"stage": 3}}}},
        r"deepspeed_config stage 3",
    ),
    ({"bits": 8, "fsdp_config": {}}, r"model_args.bits=8 with fsdp_config.*8-bit"),
    ({"bits": 4, "fsdp_config": {}}, r"bnb_4bit_quant_storage='uint8' with fsdp_config"),
    (
        {
            "bits": 4,
            "fsdp_config": {},
            "bnb_4bit_quant_storage": "float16",
            "bnb_4bit_compute_dtype": "bfloat16",
        },
        r"bnb_4bit_quant_storage='float16'.*\(bfloat16\)",
    ),
    ({"launcher": {"kind": "torchrun", "num_nodes": 2}}, "launcher.master_port must be set"),
    (
        {"launcher": {"kind": "torchrun", "num_nodes": 2, "node_rank": 2, "master_port": 29500}},
        "launcher.node_rank=2 needs num_nodes=2 above it",
    ),
    ({"launcher": {"num_processes": 2}}, "launcher.kind: Field required"),
    (
        {"bnb_4bit_quant_type": "fp4"},
        "model_args.bnb_4bit_quant_type='fp4' without model_args.bits=4",
    ),
    (
        {"bits": 8, "bnb_4bit_use_double_quant": False},
        "bnb_4bit_use_double_quant=False without model_args.bits=4",
    ),
    (
        {"fsdp_config": {"mixed_precision": "bf16"}, "mixed_precision": "fp16"},
        "two precision settings for one run",
    ),
    ({"launcher": {"kind": "torchrun", "hostfile": "hosts"}}, "launcher.hostfile"),
    ({"max_tokens_per_batch": 4096}, "max_tokens_per_batch needs packing=True"),
    (
        {"packing": True, "max_length": 512, "max_tokens_per_batch": 256},
        "max_tokens_per_batch=256 is less than one row of max_length=512",
    ),
]


def test_an_override_changes_only_its_path_even_where_yaml_aliased_it(tmp_path: Path) -> None:
    from llmtrain.config.file import apply_overrides, parse_overrides, read_config

    path = tmp_path / "fit.yaml"
    path.write_text(
        "data:\n"
        "  select: &s {table: docs, where: 'lang = :l', params: {l: en}}\n"
        "  eval_select: *s\n"
    )
    config = read_config(path)
    changed = apply_overrides(config, parse_overrides(["--data.select.params.l", "fr"]))
    assert changed["data"]["select"]["params"] == {"l": "fr"}
    assert changed["data"]["eval_select"]["params"] == {"l": "en"}
    assert config["data"]["select"]["params"] == {"l": "en"}  # the file's own, untouched


@pytest.mark.parametrize(
    ("options", "message"), REFUSED, ids=[re.sub(r"\W+", "-", m)[:40] for _, m in REFUSED]
)
def test_combinations_that_cannot_work_are_refused_when_the_trainer_is_built(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _trainer(**options)


def test_accepted_combinations() -> None:
    _trainer(bits=4, deepspeed_config={"stage": 2})
    _trainer(bits=4, deepspeed_config={"raw": "ds.json"})  # a file: its stage is read at run
    _trainer(
        bits=4, fsdp_config={}, bnb_4bit_quant_storage="bfloat16", bnb_4bit_compute_dtype="bfloat16"
    )
    _trainer(bits=4, fsdp_config={}, bnb_4bit_quant_storage="bfloat16")  # "auto": at run time
    _trainer(prompt_template=None, chat_template=True)
    _trainer(launcher=lt.Launcher(kind="torchrun", num_nodes=2, node_rank=1, master_port=29500))


def test_every_problem_is_reported_at_once_naming_its_fields() -> None:
    with pytest.raises(ConfigError) as info:
        _trainer(lora_args=None, bits=8, deepspeed_config={"stage": 3}, fsdp_config={})
    message = str(info.value)
    assert message.count("\n") == 0
    for part in (
        "deepspeed_config and fsdp_config",
        "model_args.bits=8 with lora_args=None",
        "deepspeed_config stage 3",
        "model_args.bits=8 with fsdp_config",
    ):
        assert part in message, part
    with pytest.raises(ConfigError) as info:
        lt.Launcher(kind="torchrun", num_processes=2, num_nodes=2, node_rank=3)
    assert "master_port" in str(info.value) and "node_rank=3" in str(info.value)


def test_a_stored_record_and_a_yaml_file_meet_the_same_rules() -> None:
    record = _trainer(bits=4, deepspeed_config={"stage": 2}).to_dict()
    record["deepspeed_config"]["stage"] = 3
    with pytest.raises(ConfigError, match="deepspeed_config stage 3"):
        lt.LLMTrainer.from_dict(record)
    job = {
        "name": "f",
        "db": "sqlite://",
        "prompt_template": TEMPLATE,
        "model_args": {"model_name_or_path": "m", "bits": 4},
        "deepspeed_config": {"stage": 3},
        "data": {"X": "q", "Y": "a", "select": {"table": "t"}},
    }
    with pytest.raises(ConfigError, match="LLMTrainer: .*deepspeed_config stage 3"):
        build_job(job)
    job["deepspeed_config"]["stage"] = 2
    assert build_job(job).options["deepspeed_config"]["stage"] == 2
    with pytest.raises(ConfigError, match="config.model_args: Field required"):
        build_job({k: v for k, v in job.items() if k != "model_args"})


def test_machine_rules_are_left_to_run_time_by_the_same_function() -> None:
    # the config cannot know whether the run has a GPU: the strategy asks again with cuda=
    assert quantization_problems(4, fsdp=True, quant_storage="bfloat16") == []
    (cpu,) = quantization_problems(4, fsdp=True, quant_storage="bfloat16", cuda=False)
    assert "QLoRA (bits=4) with FSDP2 does not work on the CPU" in cpu
    (mismatch,) = quantization_problems(
        4, fsdp=True, quant_storage="bfloat16", compute_dtype="float16", cuda=True
    )
    assert "bnb_4bit_quant_storage='bfloat16'" in mismatch
    assert quantization_problems(None, fsdp=True, deepspeed_stage=3, cuda=False) == []


# -- fit() leaves the recipe alone -----------------------------------------------------------
def test_fit_allow_changed_data_is_not_written_into_the_recipe(tiny: Path, tmp_path: Path) -> None:
    import sqlalchemy as sa

    from llmtrain.db.engines import sql_engine

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [{"id": i, "q": f"question {i}", "a": f"answer {i}"} for i in range(16)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    trainer = lt.LLMTrainer(
        "no-side-effects",
        model=tiny,
        prompt_template=TEMPLATE,
        max_steps=1,
        batch_size=4,
        progress_bar=False,
    )
    trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"))
    stored = db.metadata.get_component("trainer", "no-side-effects").payload
    trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"), allow_changed_data=True)
    with sql_engine(db.secret_uri()).begin() as conn:
        conn.execute(sa.text("DELETE FROM docs WHERE id = 3"))
    again = db.load("trainer", "no-side-effects")
    with pytest.raises(DataChangedError, match="allow_changed_data=True"):
        again.fit()
    again.fit(allow_changed_data=True)

    assert trainer.version == again.version == 0
    assert db.show("trainer", "no-side-effects") == [0]
    assert db.metadata.get_component("trainer", "no-side-effects").payload == stored
    assert stored["data_args"]["allow_changed_data"] is False
    assert again.config.data_args.allow_changed_data is False
    runs = db.metadata.list_runs("trainer", "no-side-effects")
    assert [r.info["allow_changed_data"] for r in runs] == [False, True, True]
    assert [r.status for r in runs] == ["completed"] * 3
    db.close()


def test_the_strategies_check_the_loaded_model_with_the_same_rules(tiny: Path) -> None:
    """What the config cannot see (a raw DeepSpeed file's stage, the machine) is checked on
    the loaded model, a real bitsandbytes 4-bit one here, by quantization_problems."""
    import torch

    from llmtrain.training.modeling import load_model
    from llmtrain.training.strategies import deepspeed, fsdp

    model = load_model(
        lt.ModelArguments(model_name_or_path=str(tiny), bits=4, bnb_4bit_quant_storage="float32"),
        torch.device("cpu"),
    )
    with pytest.raises(ConfigError, match="model_args.bits=4 with deepspeed_config stage 3"):
        deepspeed.check_quantization(model, 3)
    deepspeed.check_quantization(model, 2)
    with pytest.raises(ConfigError, match="QLoRA .bits=4. with FSDP2 does not work on the CPU"):
        fsdp.check_quantization(model, torch.device("cpu"))
    plain = load_model(lt.ModelArguments(model_name_or_path=str(tiny)), torch.device("cpu"))
    deepspeed.check_quantization(plain, 3)
    fsdp.check_quantization(plain, torch.device("cpu"))
