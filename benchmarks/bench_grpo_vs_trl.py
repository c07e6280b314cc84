"""llmtrain's GRPO against TRL's GRPOTrainer, side by side, on the CPU with transformers'
``generate``:

    python benchmarks/bench_grpo_vs_trl.py [--rows 64] [--steps 16] [--batch-size 4]
        [--generations 4] [--max-new-tokens 32] [--max-length 96] [--hidden 256] [--layers 4]
        [--vocab 512] [--repeats 3]

The same tiny random Llama (``llmtrain.testing.tiny_model``: byte-level tokenizer), the same
prompts (``write the letter e``-style rows of a SQLite table for llmtrain, a
``datasets.Dataset`` of the same prompts for TRL; TRL's prompt is the text of the ids
llmtrain's template ``"Q: {X}\\nA: {Y}"`` gives, checked token for token), read in key order
on both sides (no shuffle: the same prompts in every step). The same reward:
:func:`letter_share` (TRL's signature; llmtrain takes it as ``fit(reward="module:function")``
and passes the row's fields as keywords, TRL the dataset's columns). The same recipe: LoRA
r=8, alpha 16, dropout 0 on all attention and MLP projections; AdamW (lr 1e-4, linear
schedule, no warmup, clipping at 1.0), full precision; ``--batch-size`` prompts a step, each
sampled ``--generations`` times (temperature 1.0, top-p 1.0, no top-k) up to
``--max-new-tokens`` (TRL's ``max_completion_length``); loss ``dapo``, KL coefficient beta
0.04 against the model with its adapter off, clip epsilon 0.2, rewards scaled by the group's
std. TRL is set so that an optimizer step sees the same completions as llmtrain's and takes one
optimizer step per generation round: ``per_device_train_batch_size = batch x generations``,
``steps_per_generation=1``, ``gradient_accumulation_steps=1``, ``num_iterations=1`` (no
separate old-policy forward on either side).

Each side runs in its own subprocess (one torch thread: the machine is shared) and reports:
tokens/s, the prompt + completion tokens a step generated and trained on (prompt tokens
without padding, completion tokens up to and including EOS: llmtrain's ``run.tokens_seen``,
TRL's ``state.num_input_tokens_seen``, counted the same way) from the end of the first
optimizer step to the end of the last (model loading, setup and the first step's warm-up
left out) over that wall time, measured by a callback on each side; the same tokens per
second of the process's CPU time (less sensitive to other load on a shared machine); the peak
RSS of the process; the mean reward of the last step (each side samples with its own random
stream: the answers, and so the rewards, differ). Every side runs ``--repeats`` times,
alternating which goes first each round; the medians are shown, with each run's tokens/s and
the median of the rounds' ratios (the machine these ran on is shared and noisy). Ratios are
llmtrain / TRL. Goal: tokens/s >= 1.0x at peak RSS <= 1.0x TRL's.

Both sides train in float32: llmtrain's ``mixed_precision="no"`` (its ``auto`` is full precision
on a CPU) and TRL's ``bf16=False`` (GRPOConfig defaults to ``bf16=True``, autocast even on a
CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the SFT benchmark's helpers, and this module for llmtrain
    sys.path.insert(0, str(HERE))

from bench_vs_trl import (  # noqa: E402  (it also puts the repository on sys.path)
    LLAMA_TARGETS,
    LORA_ALPHA,
    LORA_R,
    SAME,
    _peak_mb,
    common_parser,
    run_script,
)

LR, BETA, LOSS_TYPE, TEMPERATURE = 1e-4, 0.04, "dapo", 1.0
TEMPLATE = "Q: {X}\nA: {Y}"
REWARD = f"{Path(__file__).stem}:letter_share"  # importable: this folder is on sys.path
LETTERS = "etaoinsh"
_ASKS = [
    "write the letter {c}",
    "say {c}",
    "answer with the letter {c} and nothing else",
    "repeat {c} a few times",
    "the letter {c}, please, as many times as fits",
]


def letter_share(prompts: list[str], completions: list[str], letter: list[str], **_: Any) -> Any:
    """TRL's reward signature: the share of the completion's characters that are the row's
    letter (the row's other fields, and TRL's extras, come as keywords)."""
    return [c.count(t) / max(len(c), 1) for c, t in zip(completions, letter)]


def make_rows(n: int) -> list[dict[str, Any]]:
    """``n`` (id, prompt, letter) rows, prompts of a few lengths."""
    rows = []
    for i in range(n):
        c = LETTERS[i % len(LETTERS)]
        rows.append({"id": i, "prompt": _ASKS[i % len(_ASKS)].format(c=c), "letter": c})
    return rows


def trl_prompts(model: str, rows: list[dict[str, Any]]) -> list[str]:
    """The prompt text TRL gets for each row: the text whose ids are llmtrain's prompt ids
    (its template before ``{Y}``, the trailing space healed away), checked id for id."""
    from transformers import AutoTokenizer

    from llmtrain.formatting.tokenize import Formatter

    tokenizer = AutoTokenizer.from_pretrained(model)
    formatter = Formatter(tokenizer, TEMPLATE)
    texts = []
    for row in rows:
        ids = formatter.prompt(row["prompt"]).ids
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if tokenizer(text).input_ids != ids:
            raise SystemExit(f"TRL's prompt {text!r} would not tokenize as llmtrain's")
        texts.append(text)
    return texts


class _Steps:
    """(wall time, process CPU time, cumulative tokens) at the end of every optimizer step."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float, float]] = []

    def mark(self, tokens: float) -> None:
        self.marks.append((time.perf_counter(), time.process_time(), float(tokens)))

    def result(self) -> dict[str, float]:
        (t0, c0, n0), (t1, c1, n1) = self.marks[0], self.marks[-1]
        steps = len(self.marks) - 1
        return {
            "tok_s": (n1 - n0) / (t1 - t0),
            "tok_cpu_s": (n1 - n0) / (c1 - c0),
            "tokens": n1 - n0,
            "s_step": (t1 - t0) / steps,
            "peak_mb": _peak_mb(),
        }


def run_llmtrain(args: argparse.Namespace) -> dict[str, Any]:
    import sqlite3

    import llmtrain as lt
    from llmtrain.training.callbacks import Callback

    folder = Path(args.workdir)
    rows = make_rows(args.rows)
    con = sqlite3.connect(folder / "qa.db")
    con.execute("CREATE TABLE qa (id INTEGER PRIMARY KEY, prompt TEXT, letter TEXT)")
    con.executemany("INSERT INTO qa VALUES (:id, :prompt, :letter)", rows)
    con.commit()
    con.close()
    steps = _Steps()

    class Clock(Callback):
        def on_step(self, run: Any, keys: list[str]) -> None:
            steps.mark(run.tokens_seen)

    trainer = lt.LLMTrainer(
        "grpo-bench",
        model=args.model,
        objective="grpo",
        prompt_template=TEMPLATE,
        max_length=args.max_length,
        batch_size=args.batch_size,
        learning_rate=LR,
        max_steps=args.steps,
        **SAME,
        num_generations=args.generations,
        max_new_tokens=args.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        beta=BETA,
        epsilon=0.2,
        scale_rewards="group",
        loss_type=LOSS_TYPE,
    )
    db = lt.connect(f"sqlite:///{folder / 'qa.db'}", artifacts=folder / "artifacts")
    model = trainer.fit(
        X="prompt",
        Y="letter",
        db=db,
        select=lt.Table("qa"),
        reward=REWARD,
        callbacks=[Clock()],
    )
    last = db.metadata.get_metrics(model.record.run_id)[-1].values
    return steps.result() | {"reward": last["reward"]}


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl_recipe import trl_lora

    rows = make_rows(args.rows)
    prompts = trl_prompts(args.model, rows)
    data = Dataset.from_list([{"prompt": p, "letter": r["letter"]} for p, r in zip(prompts, rows)])
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size * args.generations,  # completions
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=BETA,
        epsilon=0.2,
        scale_rewards="group",
        loss_type=LOSS_TYPE,
        shuffle_dataset=False,  # key order, as llmtrain with shuffle=False
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    steps = _Steps()

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            steps.mark(state.num_input_tokens_seen)

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
        reward_funcs=letter_share,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        peft_config=trl_lora(LORA_R, LORA_ALPHA, LLAMA_TARGETS),  # reference: adapter off
        callbacks=[Clock()],
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return steps.result() | {"reward": rewards[-1]}


def run_child(name: str, args: argparse.Namespace, model: Path, folder: Path) -> Any:
    folder.mkdir(parents=True, exist_ok=True)
    flags = ("rows", "steps", "batch_size", "generations", "max_new_tokens", "max_length")
    extra = ("--model", str(model), "--workdir", str(folder))
    return run_script(__file__, name, args, flags, *extra)


def main() -> None:
    parser = common_parser(__doc__)
    parser.set_defaults(rows=64, steps=16, batch_size=4, max_length=96, hidden=256, layers=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        fn = run_llmtrain if args.child == "llmtrain" else run_trl
        print("RESULT " + json.dumps(fn(args)))
        return
    if args.rows < args.steps * args.batch_size:
        sys.exit(f"--rows {args.rows} < steps x batch-size: an epoch would end mid-run")
    if args.steps < 2:
        sys.exit("--steps must be at least 2: the first step is left out of the timing")

    from llmtrain.testing import tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="bench-grpo-vs-trl-"))
    try:
        model = tiny_model(
            workdir / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            vocab_size=args.vocab,
        )
        trl_prompts(str(model), make_rows(args.rows))  # fails early if they would differ
        runs: dict[str, list[dict[str, float]]] = {"llmtrain": [], "trl": []}
        for i in range(args.repeats):  # alternating: each side goes first every other round
            for name in ["llmtrain", "trl"] if i % 2 == 0 else ["trl", "llmtrain"]:
                runs[name].append(run_child(name, args, model, workdir / f"round{i}" / name))
        results = {
            name: {key: statistics.median(r[key] for r in got) for key in got[0]}
            for name, got in runs.items()
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"GRPO ({LOSS_TYPE}, beta {BETA}, lr {LR}), tiny Llama hidden {args.hidden} x "
        f"{args.layers} layers, vocab {args.vocab}; {args.steps} steps of {args.batch_size} "
        f"prompts x {args.generations} generations, max_new_tokens {args.max_new_tokens}, "
        f"temperature {TEMPERATURE}; LoRA r={LORA_R} alpha {LORA_ALPHA}; {args.threads} "
        f"thread(s); timed from step 1's end to step {args.steps}'s; median of {args.repeats} "
        "runs a side, alternating"
    )
    print()
    print(
        "| side | tokens/s (median) | peak RSS MB | last mean reward | s/step | tokens timed "
        "| tokens per CPU-s | tokens/s of each run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        each = ", ".join(f"{x['tok_s']:.0f}" for x in runs[name])
        print(
            f"| {name} | {r['tok_s']:.0f} | {r['peak_mb']:.0f} | {r['reward']:.3f} | "
            f"{r['s_step']:.2f} | {r['tokens']:.0f} | {r['tok_cpu_s']:.0f} | {each} |"
        )
    ours, theirs = results["llmtrain"], results["trl"]
    speed, memory = ours["tok_s"] / theirs["tok_s"], ours["peak_mb"] / theirs["peak_mb"]
    cpu = ours["tok_cpu_s"] / theirs["tok_cpu_s"]
    paired = statistics.median(
        a["tok_s"] / b["tok_s"] for a, b in zip(runs["llmtrain"], runs["trl"])
    )
    ok = "PASS" if speed >= 1.0 and memory <= 1.0 else "FAIL"
    print()
    print(
        f"llmtrain / TRL: tokens/s {speed:.2f}x (median of the rounds' ratios {paired:.2f}x; "
        f"per CPU-second {cpu:.2f}x), peak RSS {memory:.2f}x  [{ok}]"
    )


if __name__ == "__main__":
    main()
