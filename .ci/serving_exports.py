"""The serving lane's first half, in the project's environment: fit tiny models as a user would,
export them (adapter, merged, and GGUF by `llmtrain export --format gguf`), and note what
generate() answers; .ci/serving_check.py asks the real stacks.

    LLAMA_CPP_CONVERTERS=DIR python3 .ci/serving_exports.py OUT

DIR: llama.cpp's converters (llmtrain.training.gguf.converters()); the `gguf` extra's
sentencepiece and the llama-cpp-python binding (k-quants) on PYTHONPATH (.ci/serving).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import warnings
from contextlib import closing
from pathlib import Path
from typing import Any

import llmtrain as lt
from llmtrain.cli import main as cli
from llmtrain.formatting import PromptTemplate
from llmtrain.testing import tiny_model

COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
ROWS = [(i, f"What is color number {i % 8}?", COLORS[i % 8]) for i in range(64)]
PROMPTS = [f"What is color number {i}?" for i in range(8)]
#: the merged GGUF's types; a k-quant quantises rows of 256 (QK_K), so the tiny model is 256 wide
QUANTS = ("f16", "q8_0", "q5_k_m", "q4_k_m")
#: the fits learn their rows, each answer token 9 nats or more ahead of the next, so a k-quant's
#: error flips none (fits that half learned them left answers whose logits lay close, and 5 bits
#: flipped some):
#: every linear layer, and a tokenizer trained on the templates' texts, which a random 2-layer
#: base needs to carry a prompt's digit to its answer
FIT = {"max_steps": 200, "learning_rate": 5e-3, "target_modules": "all-linear"}
KINDS: dict[
    str, dict[str, Any]
] = {  # name: trainer options; a head size vLLM's CPU attention takes (256 / 4 heads)
    "plain": {"prompt_template": "### Instruction:\n{X}\n\n### Response:\n{Y}"},
    "healed": {"prompt_template": "Q: {X} A: {Y}"},  # ends in a space: the answer's first token
    "chat": {"chat_template": True},
    "dora": {"prompt_template": "Q: {X}\nA:{Y}", "use_dora": True},  # to serve merged
}


def completion_prompt(model: lt.TrainedModel, x: str, heal: str) -> str:
    """The text a user sends a completion endpoint (which adds BOS): the training prompt
    without its healed tail; for a chat-trained model, its chat template rendered."""
    if model.record.prompt_template is None:
        tokenizer = model.formatter().tokenizer
        chat = [{"role": "user", "content": x}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return str(text).removeprefix(tokenizer.bos_token)
    text = PromptTemplate(model.record.prompt_template).prompt(x)
    return text[: len(text) - len(heal)]


#: llama.cpp knows BPE pre-tokenizers by the hash of a probe's ids; the tiny byte-level test
#: tokenizer splits as GPT-2 does (its ByteLevel regex) under a hash of its own vocabulary
WRAPPER = """import runpy, sys
sys.path[:0] = [{real!r}, {real!r} + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path({real!r} + "/{script}", run_name="__main__")
"""


def converters(out: Path) -> Path:
    """llama.cpp's converters, the tiny tokenizer's pre-tokenizer named (see WRAPPER)."""
    folder = out / "llama.cpp"
    folder.mkdir(exist_ok=True)
    real = os.environ["LLAMA_CPP_CONVERTERS"]
    for script in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py"):
        (folder / script).write_text(WRAPPER.format(real=real, script=script))
    return folder


def export_gguf(db: lt.Datalayer, name: str, dest: Path, *options: str) -> None:
    """``llmtrain export NAME --format gguf ...``, as a user runs it."""
    argv = ["export", name, "--db", db.uri, "--artifacts", str(db.artifacts.root)]
    assert cli([*argv, "--format", "gguf", *options, str(dest)]) == 0, (name, options)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(out / "data.db")) as con, con:
        con.execute("CREATE TABLE IF NOT EXISTS docs (id INTEGER PRIMARY KEY, q TEXT, a TEXT)")
        con.executemany("INSERT OR REPLACE INTO docs VALUES (?, ?, ?)", ROWS)
    db = lt.connect(f"sqlite:///{out / 'data.db'}", artifacts=out / "artifacts")
    texts = [
        PromptTemplate(kind["prompt_template"]).prompt(x) + y
        for kind in KINDS.values()
        if "prompt_template" in kind
        for _, x, y in ROWS
    ]
    base = tiny_model(out / "base", hidden_size=256, num_heads=4, corpus=texts)
    llama_cpp = converters(out)
    cases = []
    for name, options in KINDS.items():
        trainer = lt.LLMTrainer(
            name,
            model=str(base),
            batch_size=8,
            lora_dropout=0.0,
            progress_bar=False,
            **FIT,
            **options,
        )
        model = trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"))
        refused = None
        if options.get("use_dora"):  # refused with strict=True, written with a warning without
            try:
                model.export_adapter(out / name / "adapter", strict=True)
            except lt.ConfigError as exc:
                refused = str(exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.export_adapter(out / name / "adapter")
            model.export_merged(out / name / "merged")
        note = json.loads((out / name / "merged" / "llmtrain_export.json").read_text())
        gguf = {}
        for quant in QUANTS:  # the merged model, and the plain LoRA against the base's GGUF
            dest = out / name / f"gguf-{quant}"
            export_gguf(db, name, dest, "--quant", quant, "--llama-cpp", str(llama_cpp), "--merged")
            gguf[f"merged {quant}"] = str(dest)
        try:
            model.export_gguf(out / name / "gguf-lora", lora=True, llama_cpp=llama_cpp)
            gguf["base + LoRA f16"] = str(out / name / "gguf-lora")
        except lt.ConfigError as exc:
            gguf["refused"] = str(exc)
        print(name, "GGUF", gguf, flush=True)
        cases.append(
            {
                "name": name,
                "base": str(base),
                "adapter": str(out / name / "adapter"),
                "merged": str(out / name / "merged"),
                "heal": note["heal"],
                "completion_prompts": [completion_prompt(model, x, note["heal"]) for x in PROMPTS],
                "prompts": PROMPTS,
                "answers": model.generate(PROMPTS, max_new_tokens=6),
                "refused": refused,
                "gguf": gguf,
                "warnings": sorted(
                    {str(w.message) for w in caught if w.category is lt.ServingWarning}
                ),
            }
        )
        learned = sum(a == c for a, c in zip(cases[-1]["answers"], COLORS))
        print(name, f"answers ({learned}/8 as its rows)", cases[-1]["answers"], flush=True)
    (out / "cases.json").write_text(json.dumps(cases, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
