"""Evaluation beyond loss and outputs for serving stacks, on one SQLite file and a tiny model:
eval metrics by generation, the best checkpoint kept and loaded, the adapter and merged model
exported and loaded by stock PEFT/transformers, QLoRA merged into the weights it trained
against, a reproducible adapter id across hash seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill
from safetensors.torch import load_file

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.db.keys import held_out
from llmtrain.errors import ConfigError
from llmtrain.testing import tiny_model
from llmtrain.training.export import STACKS

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
ROWS = [
    {"id": i, "instruction": f"What is color number {i % 8}?", "output": COLORS[i % 8]}
    for i in range(48)
]
PROMPT = "What is color number 2?"


def answer_words(prediction: str, reference: str) -> float:
    """A user metric, named by its import path: the words of the answer."""
    return float(len(prediction.split()))


def reference_rank(prediction: str, reference: str) -> float:
    """A user metric that tells which rows were scored: the reference's place in COLORS;
    with SCORED_LOG set, each call also notes the scoring process and the reference."""
    if os.environ.get("SCORED_LOG"):
        with open(os.environ["SCORED_LOG"], "a") as log:
            log.write(f"{os.getpid()} {reference}\n")
    return float(COLORS.index(reference) + 1)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("export")
    uri = f"sqlite:///{folder / 'data.db'}"
    fill(uri, "docs", ROWS)
    return lt.connect(uri, artifacts=folder / "artifacts")


def _fit(tiny: Path, db: Any, name: str, **options: Any) -> Any:
    settings: dict[str, Any] = {
        "max_steps": 4,
        "batch_size": 4,
        "learning_rate": 1e-2,
        "progress_bar": False,
        "logging_steps": 1,
        "lora_dropout": 0.0,
        **options,
    }
    trainer = lt.LLMTrainer(name, model=tiny, prompt_template=TEMPLATE, **settings)
    return trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))


@pytest.fixture(scope="module")
def scored(tiny: Path, db: Any) -> Any:
    """Evaluated every 2 steps by loss and by generation; the best checkpoint is the one
    with the *highest* eval loss (greater_is_better=True), so it is not the newest."""
    return _fit(
        tiny,
        db,
        "scored",
        max_steps=4,
        eval_fraction=0.25,
        eval_steps=2,
        save_steps=2,
        per_device_eval_batch_size=16,
        save_total_limit=1,
        eval_metrics=["exact_match", "contains", "test_export:answer_words"],
        eval_max_new_tokens=4,
        save_best_by="eval_loss",
        greater_is_better=True,
    )


def _logits(model: Any, tokenizer: Any) -> torch.Tensor:
    ids = tokenizer([PROMPT], return_tensors="pt").input_ids
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_eval_metrics_score_greedy_answers_through_the_template(scored: Any, db: Any) -> None:
    metrics = db.metadata.get_metrics(scored.record.run_id)
    evals = {m.step: m.values for m in metrics if "eval_loss" in m.values}
    assert sorted(evals) == [2, 4]
    for values in evals.values():
        assert {"eval_exact_match", "eval_contains", "eval_answer_words"} <= set(values)
        assert 0 <= values["eval_exact_match"] <= values["eval_contains"] <= 1
    # the final scores are those of the stored model answering the held-out rows one by one
    rows = [r for r in ROWS if held_out(r["id"], 0.25)]
    prompts = [r["instruction"] for r in rows]
    answers = db.load("model", "scored").generate(prompts, max_new_tokens=4)
    expected = {
        "eval_exact_match": sum(a.strip() == r["output"] for a, r in zip(answers, rows)),
        "eval_contains": sum(r["output"] in a for a, r in zip(answers, rows)),
        "eval_answer_words": sum(len(a.split()) for a in answers),
    }
    for name, total in expected.items():
        assert evals[4][name] == pytest.approx(total / len(rows)), name


def test_two_ranks_score_each_held_out_row_once_as_one_process_would(
    tiny: Path, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun each rank answers its shard of the held-out rows; the means taken over
    both ranks are those of the stored model answering every held-out row once."""
    tests = str(Path(__file__).parent)  # the workers import this module's metrics
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    scored_log = Path(db.artifacts.root).parent / "scored.log"
    monkeypatch.setenv("SCORED_LOG", str(scored_log))
    model = _fit(
        tiny,
        db,
        "scored-2",
        max_steps=2,
        batch_size=2,
        eval_fraction=0.25,
        per_device_eval_batch_size=3,
        eval_metrics=["test_export:answer_words", "test_export:reference_rank", "contains"],
        eval_max_new_tokens=4,
        launcher=lt.Launcher(kind="torchrun", num_processes=2),
    )
    run = db.metadata.get_run(model.record.run_id)
    assert run.info["world_size"] == 2
    (final,) = [m.values for m in db.metadata.get_metrics(run.run_id) if "eval_loss" in m.values]
    rows = [r for r in ROWS if held_out(r["id"], 0.25)]
    scored = [line.split() for line in scored_log.read_text().splitlines()]
    assert len({pid for pid, _ in scored}) == 2  # both ranks scored, in their own processes
    assert sorted(ref for _, ref in scored) == sorted(r["output"] for r in rows)  # each once
    answers = db.load("model", "scored-2").generate(
        [r["instruction"] for r in rows], max_new_tokens=4
    )
    assert final["eval_reference_rank"] == pytest.approx(
        sum(COLORS.index(r["output"]) + 1 for r in rows) / len(rows)
    )
    assert final["eval_answer_words"] == pytest.approx(
        sum(len(a.split()) for a in answers) / len(rows)
    )
    assert final["eval_contains"] == pytest.approx(
        sum(r["output"] in a for a, r in zip(answers, rows)) / len(rows)
    )


def test_the_best_checkpoint_survives_pruning_and_loads(scored: Any, db: Any) -> None:
    run = db.metadata.get_run(scored.record.run_id)
    losses = {
        m.step: m.values["eval_loss"]
        for m in db.metadata.get_metrics(run.run_id)
        if "eval_loss" in m.values
    }
    best_step = max(losses, key=losses.__getitem__)
    assert best_step != 4, "the test needs a best checkpoint that is not the newest"
    best = run.info["best_checkpoint"]
    assert (best["step"], best["metric"]) == (best_step, "eval_loss")
    assert best["value"] == pytest.approx(losses[best_step])
    # save_total_limit=1 keeps the newest, and the best as well
    assert [c.step for c in db.metadata.list_checkpoints(run.run_id)] == [best_step, 4]
    assert db.artifacts.exists(best["artifact"])

    loaded = db.load("model", "scored", checkpoint="best")
    model, _ = loaded.load(device="cpu")
    folder = Path(db.artifacts.root).parent / "best-ckpt"
    db.artifacts.get_dir(best["artifact"], folder)
    saved = load_file(str(folder / "weights.safetensors"))
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    assert saved.keys() == state.keys()
    for key, value in saved.items():
        torch.testing.assert_close(state[key], value)
    final, tokenizer = db.load("model", "scored").load(device="cpu")
    assert not torch.allclose(_logits(model, tokenizer), _logits(final, tokenizer))
    with pytest.raises(ConfigError, match="no checkpoint '99'"):
        db.load("model", "scored", checkpoint=99)


def test_save_best_by_needs_rows_to_evaluate_on(tiny: Path, db: Any) -> None:
    with pytest.raises(ConfigError, match=r"save_best_by need rows to evaluate on"):
        _fit(tiny, db, "nobest", save_best_by="eval_loss")
    assert db.metadata.list_runs("trainer", "nobest") == []
    with pytest.raises(ConfigError, match=r"eval_metrics\[1\].*cannot be imported"):
        lt.LLMTrainer("m", model=tiny, prompt_template=TEMPLATE, eval_metrics=["contains", "x:y"])
    with pytest.raises(ConfigError, match="save_best_by='eval_bleu' is not scored"):
        lt.LLMTrainer("m", model=tiny, prompt_template=TEMPLATE, save_best_by="eval_bleu")


def test_export_writes_what_stock_peft_and_transformers_load(
    scored: Any, db: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, tokenizer = db.load("model", "scored").load(device="cpu")
    expected = _logits(ours, tokenizer)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    argv = ["export", "scored", "--db", db.uri, "--artifacts", str(db.artifacts.root)]
    assert main([*argv, "--adapter", str(adapter), "--merged", str(merged)]) == 0
    assert "merged into the full-precision base weights" in capsys.readouterr().out

    base = AutoModelForCausalLM.from_pretrained(scored.record.base.model_name_or_path)
    stock = PeftModel.from_pretrained(base, adapter)
    torch.testing.assert_close(_logits(stock, tokenizer), expected)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(config["target_modules"])

    assert {p.suffix for p in merged.iterdir()} >= {".safetensors"}
    plain = AutoModelForCausalLM.from_pretrained(merged)
    stock_tokenizer = AutoTokenizer.from_pretrained(merged)
    assert stock_tokenizer(PROMPT).input_ids == tokenizer(PROMPT).input_ids
    torch.testing.assert_close(_logits(plain, tokenizer), expected, rtol=1e-4, atol=1e-4)
    # a folder that holds something is refused, and nothing is half-written
    assert main([*argv, "--adapter", str(adapter)]) == 2
    capsys.readouterr()  # a checkpoint that is not there is the user's mistake: one line, 2
    assert main([*argv, "--checkpoint", "bset", "--adapter", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.endswith("has no checkpoint 'bset'\n")
    # the best checkpoint's weights, in the same layout
    best = tmp_path / "best"
    assert main([*argv, "--checkpoint", "best", "--adapter", str(best)]) == 0
    checkpoint = db.metadata.get_run(scored.record.run_id).info["best_checkpoint"]
    db.artifacts.get_dir(checkpoint["artifact"], tmp_path / "ckpt")
    saved = load_file(str(tmp_path / "ckpt" / "weights.safetensors"))
    exported = load_file(str(best / "adapter_model.safetensors"))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    note = json.loads((best / "llmtrain_export.json").read_text())
    assert (note["checkpoint"], note["version"]) == (checkpoint["step"], 0)


def test_qlora_merges_into_the_dequantised_weights_it_trained_against(
    tiny: Path, db: Any, tmp_path: Path
) -> None:
    """The trained model as training computed it (train mode; no dropout here): bitsandbytes'
    CPU inference kernel (eval mode, bf16, weights repacked) differs from it by ~0.1 itself."""
    from transformers import AutoModelForCausalLM

    model = _fit(tiny, db, "qlora", bits=4, qlora=True, max_steps=2)
    trained, tokenizer = model.load(device="cpu")
    ids = tokenizer([PROMPT], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = trained.train()(input_ids=ids).logits
    assert "dequantised 4-bit" in model.export_merged(tmp_path / "trained")
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "trained"), tokenizer)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)
    note = json.loads((tmp_path / "trained" / "llmtrain_export.json").read_text())
    assert note["into"] == "trained"

    assert "full-precision" in model.export_merged(tmp_path / "base", into="base")
    other = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tokenizer)
    assert (other - expected).abs().max() > 1  # what merging into the fp base used to give


@pytest.fixture(scope="module")
def other(tiny: Path, db: Any) -> Any:
    return _fit(tiny, db, "other", max_steps=2, seed=7)


_TRAIN_AGAIN = """
import sys, llmtrain as lt
from conftest import fill
from test_export import ROWS, _fit
db = lt.connect(sys.argv[1], artifacts=sys.argv[2])
fill(sys.argv[1], "docs", ROWS)
print("ADAPTER", _fit(sys.argv[3], db, "other", max_steps=2, seed=7).record.adapter)
"""


def test_the_adapter_id_does_not_depend_on_the_hash_seed(
    other: Any, tiny: Path, tmp_path: Path
) -> None:
    """The same fit in a process with another hash seed (PEFT keeps target_modules in a set)
    stores the same adapter bytes, so the same content id."""
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    argv = [sys.executable, "-c", _TRAIN_AGAIN, f"sqlite:///{tmp_path / 'again.db'}"]
    result = subprocess.run(
        [*argv, str(tmp_path / "artifacts"), str(tiny)],
        env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("ADAPTER")]
    assert line.split()[1] == other.record.adapter


# -- serving: the prompt travels with the export, what the stacks refuse is said at export -----
HEALED = "Q: {X} A: {Y}"  # its prompt ends in a space the answer's first token carries


def _fed_ids(model: Any, x: str) -> list[int]:
    """The ids generate() gives the model for ``x``: its embedding layer's first input."""
    torch_model, _ = model.load(device="cpu")
    seen: list[list[int]] = []
    hook = torch_model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0][0].tolist())
    )
    try:
        model.generate(x, max_new_tokens=1)
    finally:
        hook.remove()
    return seen[0]


def _chat_ids(folder: Path, x: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": x}]
    return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("style", ["bytelevel", "metaspace"])
def test_the_exported_chat_template_renders_the_healed_training_prompt(
    style: str, db: Any, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Chat endpoints render the export's chat template: its ids are those generate() gives the
    model, the prompt's last space left for the answer's first token (``Ġred``/``▁red``) as in
    training; completions are sent the prompt without that space (BOS added by the server)."""
    from transformers import AutoTokenizer

    tiny = tiny_model(tmp_path_factory.mktemp("models") / style, tokenizer=style)
    trainer = lt.LLMTrainer(f"healed-{style}", model=tiny, prompt_template=HEALED, max_steps=1)
    model = trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
    with pytest.warns(lt.ServingWarning, match="last characters ' '"):
        model.export_adapter(tmp_path / "adapter")
    with pytest.warns(lt.ServingWarning, match="last characters ' '"):
        model.export_merged(tmp_path / "merged")
    for x in (PROMPT, "What is the capital of France?", "ünïcode ✓"):
        fed = _fed_ids(model, x)
        assert _chat_ids(tmp_path / "adapter", x) == _chat_ids(tmp_path / "merged", x) == fed
        completion = AutoTokenizer.from_pretrained(tmp_path / "merged")(f"Q: {x} A:")
        assert completion.input_ids == fed
    note = json.loads((tmp_path / "merged" / "llmtrain_export.json").read_text())
    run = db.metadata.get_run(model.record.run_id)
    assert note == {
        "export": "merged",
        "into": "trained",
        "merged_into": "full-precision base weights",
        "model": f"healed-{style}",
        "version": model.version,
        "run_id": run.run_id,
        "checkpoint": None,
        "base": str(tiny),
        "revision": None,
        "objective": "sft",
        "prompt_template": HEALED,
        "chat_template": False,
        "eos_token": "</s>",
        "heal": " ",
    }
    adapter_note = json.loads((tmp_path / "adapter" / "llmtrain_export.json").read_text())
    assert adapter_note["export"] == "adapter" and adapter_note["heal"] == " "


def test_a_chat_template_trained_model_keeps_its_own_template(
    tiny: Path, db: Any, tmp_path: Path
) -> None:
    from llmtrain.testing import CHAT_TEMPLATE

    trainer = lt.LLMTrainer("chatty", model=tiny, chat_template=True, max_steps=1)
    model = trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
    model.export_merged(tmp_path / "merged", strict=True)  # nothing to heal: no warning
    assert (tmp_path / "merged" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert _chat_ids(tmp_path / "merged", PROMPT) == _fed_ids(model, PROMPT)
    assert json.loads((tmp_path / "merged" / "llmtrain_export.json").read_text())["heal"] == ""


def test_export_checks_say_what_each_stack_refuses_and_strict_refuses_it(
    tiny: Path, db: Any, other: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's engine dies on a DoRA adapter (and with it every adapter it serves) and on one
    of a rank above max_lora_rank; llama.cpp's LoRA converter (Ollama's too) takes lora_A/B
    tensors alone: each is said at export, with the way out, and --strict writes nothing."""
    _fit(tiny, db, "dora", max_steps=1, use_dora=True)
    _fit(tiny, db, "odd", max_steps=1, lora_r=12, bias="all")
    argv = ["--db", db.uri, "--artifacts", str(db.artifacts.root)]

    def export(name: str, *options: str) -> tuple[int, list[str]]:
        status = main(["export", name, *argv, *options])
        out = capsys.readouterr()
        return status, [line for line in (out.out + out.err).splitlines() if line]

    dora = "vllm, llama.cpp, ollama refuse a DoRA adapter: export --merged instead"
    assert export("dora", "--adapter", str(tmp_path / "a"), "--strict") == (
        2,
        [
            f"warning: {dora}",
            "llmtrain: error: export of dora v0 refused for vllm,llama.cpp,ollama: see the "
            "warnings",
        ],
    )
    assert not (tmp_path / "a").exists()
    status, lines = export("dora", "--adapter", str(tmp_path / "a"))  # a warning only
    assert status == 0 and lines[0] == f"warning: {dora}"
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["use_dora"]
    assert export("dora", "--merged", str(tmp_path / "m"), "--strict")[0] == 0  # merged: fine

    status, lines = export("odd", "--check", "vllm")
    assert status == 2 and lines[:2] == [
        "warning: vllm refuse trained LoRA biases: export --merged instead",
        "warning: vllm: rank 12 is not one of max_lora_rank (1, 8, 16, 32, 64, 128, 256, 320, "
        "512): serve with max_lora_rank=16",
    ]
    status, lines = export("odd", "--check", "llama.cpp")  # no rank limit there
    assert status == 2 and len(lines) == 2 and "rank" not in " ".join(lines)
    assert export("other", "--check", "vllm,llama.cpp,ollama") == (
        0,
        ["other v0: vllm, llama.cpp, ollama serve it as trained"],
    )
    status, lines = export("other", "--check", "vllm,tgi")
    assert status == 2 and lines == [
        "llmtrain: error: --check tgi: not a stack; name some of ('vllm', 'llama.cpp', 'ollama')"
    ]
    assert export("other")[1][-1].startswith("llmtrain: error: export needs --adapter DIR")


def test_modules_to_save_and_ranks_above_vllms_largest_are_served_merged() -> None:
    """vLLM takes modules_to_save of a classifier/score head alone, llama.cpp none."""
    from llmtrain.training.export import serving_problems

    (problem,) = serving_problems({"r": 1024}, "", ["vllm"])
    assert problem.endswith("512): export --merged instead")
    assert serving_problems({"r": 8, "modules_to_save": ["lm_head"]}, "", list(STACKS)) == [
        "vllm, llama.cpp, ollama refuse modules_to_save {'lm_head'}: export --merged instead"
    ]
    assert serving_problems({"r": 64, "modules_to_save": ["score"]}, "", list(STACKS)) == [
        "llama.cpp, ollama refuse modules_to_save {'score'}: export --merged instead"
    ]
    assert serving_problems({"r": 64, "use_dora": True}, " ", []) == []
