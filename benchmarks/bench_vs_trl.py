"""llmtrain against TRL's SFTTrainer, side by side, packing off and on:

    python benchmarks/bench_vs_trl.py [--rows 400] [--steps 12] [--batch-size 8]
                                      [--max-length 256] [--hidden 64] [--layers 2]
                                      [--repeats 3]

The same tiny random Llama (``llmtrain.testing.tiny_model``), the same rows
(log-normal prompt and answer lengths; a SQLite table for
llmtrain, a prompt/completion ``datasets.Dataset`` for TRL, the prompt rendered with the same
template), the same LoRA config (r=8, alpha 16, dropout 0, all attention and MLP
projections), AdamW (lr 2e-4, linear schedule, no warmup, clipping at 1.0), full precision,
no gradient checkpointing, the same number of optimizer steps, a loss on the completion only.

* packing off: ``batch_size`` examples per step, right-padded, on both sides;
* packing on: TRL packs the dataset best-fit-decreasing into rows of ``max_length``
  (padding-free, position ids), ``batch_size`` rows a step; llmtrain packs each step's rows
  into micro-batches of ``max_tokens_per_batch = batch_size x max_length`` tokens, with as
  many rows per step as fill that budget on average, so both train about as many tokens a
  step.

Each contender runs in its own subprocess (one torch thread: the machine is shared), which
reports: real tokens/s (non-padding input tokens over the training loop's time: TRL from
``on_train_begin`` to ``on_train_end``, after its tokenization; llmtrain's ``tokens_per_s``
metric, which includes reading and tokenizing the rows), the peak RSS of the process, the
real-token fraction of the positions fed to the model and the loss of the last step.
Every contender runs ``--repeats`` times, the order rotating each round, and the medians are
shown (the machine these ran on is shared and noisy). Ratios are llmtrain / TRL.
Goal: tokens/s >= 1.0x at peak RSS <= 1.0x, packing on and off.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import synthetic_rows  # noqa: E402

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR, LORA_R, LORA_ALPHA = 2e-4, 8, 16
#: what the preference and GRPO benchmarks' llmtrain side trains with (TRL's side set alike)
SAME: dict[str, Any] = {
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "lora_r": LORA_R,
    "lora_alpha": LORA_ALPHA,
    "lora_dropout": 0.0,
    "target_modules": LLAMA_TARGETS,
    "shuffle": False,
    "mixed_precision": "no",
    "torch_dtype": "float32",
    "progress_bar": False,
    "logging_steps": 1,
}
_WORDS = [
    "the",
    "model",
    "reads",
    "rows",
    "from",
    "a",
    "database",
    "and",
    "learns",
    "to",
    "answer",
    "questions",
    "about",
    "colors",
    "numbers",
    "cities",
    "rivers",
    "planets",
    "music",
    "history",
    "code",
    "tables",
    "keys",
    "values",
    "training",
    "steps",
    "tokens",
    "gradients",
    "adapters",
    "layers",
    "memory",
    "speed",
    "batches",
    "examples",
    "prompts",
    "responses",
]


def make_rows(n: int, seed: int = 0) -> list[tuple[int, str, str]]:
    """Short to long prompts, and answers with a long tail (log-normal word counts)."""
    return synthetic_rows.make_rows(n, seed, _WORDS)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_llmtrain(args: argparse.Namespace, packing: bool) -> dict[str, Any]:
    import sqlite3

    import llmtrain as lt
    from llmtrain.training import run as run_module

    folder = Path(args.workdir)
    uri = f"sqlite:///{folder / 'rows.db'}"
    if not (folder / "rows.db").exists():
        con = sqlite3.connect(folder / "rows.db")
        con.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)")
        con.executemany("INSERT INTO docs VALUES (?, ?, ?)", make_rows(args.rows))
        con.commit()
        con.close()
    positions = {"n": 0}
    to_device = run_module.to_device

    def counted(batch: dict[str, Any], device: Any) -> dict[str, Any]:
        positions["n"] += batch["input_ids"].numel()
        return to_device(batch, device)

    run_module.to_device = counted  # type: ignore[assignment]
    options: dict[str, Any] = {
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": LR,
        "lora_r": LORA_R,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": LLAMA_TARGETS,
        "max_length": args.max_length,
        "progress_bar": False,
        "logging_steps": 1,
        "mixed_precision": "no",
    }
    if packing:
        options.update(
            packing=True,
            batch_size=args.packed_rows,
            max_tokens_per_batch=args.batch_size * args.max_length,
        )
    trainer = lt.LLMTrainer(
        f"bench-{packing}", model=args.model, prompt_template=TEMPLATE, **options
    )
    db = lt.connect(uri, artifacts=folder / f"artifacts-{packing}")
    model = trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
    metrics = db.metadata.get_metrics(model.record.run_id)
    last = metrics[-1].values
    return {
        "tok_s": last["tokens_per_s"],
        "tokens": last["tokens"],
        "fraction": last["tokens"] / max(positions["n"], 1),
        "loss": last["loss"],
        "peak_mb": _peak_mb(),
    }


def run_trl(args: argparse.Namespace, packing: bool) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer
    from trl_recipe import trl_configs

    prompt_only = TEMPLATE.replace("{Y}", "")
    rows = [
        {"prompt": prompt_only.replace("{X}", x), "completion": y}
        for _, x, y in make_rows(args.rows)
    ]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config, lora = trl_configs(
        str(Path(args.workdir) / f"trl-{packing}"),
        steps=args.steps,
        batch_size=args.batch_size,
        max_length=args.max_length,
        packing=packing,
        lr=LR,
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        targets=LLAMA_TARGETS,
    )

    def make(callbacks: list[Any]) -> Any:
        return SFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=callbacks,
        )

    return timed_train(make, lambda trainer: model.model)  # the inner LlamaModel


def median_rounds(
    names: list[str], repeats: int, run: Callable[[str, int], dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Each contender ``repeats`` times, the order rotating each round (load bursts hit every
    contender), and the median of each figure."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            rounds[name].append(run(name, i))
    return {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }


def timed_train(make: Callable[[list[Any]], Any], inner: Callable[[Any], Any]) -> dict[str, Any]:
    """Train ``make(callbacks)``: the real tokens ``inner(trainer)`` (the model inside the
    wrappers) receives with grad on (the policy's forward; the loader may fetch ahead), over
    the time from on_train_begin to on_train_end."""
    import torch
    from transformers import TrainerCallback

    clock: dict[str, float] = {}
    counts = {"real": 0, "positions": 0}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock["start"] = time.perf_counter()

        def on_train_end(self, *a: Any, **k: Any) -> None:
            clock["end"] = time.perf_counter()

    trainer = make([Clock()])

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is None or not torch.is_grad_enabled():
            return
        counts["real"] += int(mask.sum()) if mask is not None and mask.dim() == 2 else ids.numel()
        counts["positions"] += ids.numel()

    inner(trainer).register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    seconds = clock["end"] - clock["start"]
    return {
        "tok_s": counts["real"] / seconds,
        "tokens": counts["real"],
        "fraction": counts["real"] / max(counts["positions"], 1),
        "loss": losses[-1],
        "peak_mb": _peak_mb(),
    }


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    side, packing = args.child.split("-")
    fn = run_llmtrain if side == "llmtrain" else run_trl
    print("RESULT " + json.dumps(fn(args, packing == "packed")))


def run_script(
    script: str, name: str, args: argparse.Namespace, flags: tuple[str, ...], *extra: str
) -> Any:
    """``script --child name`` in its own process (its peak RSS its own), ``args``' ``flags``
    passed on; the ``RESULT`` line it prints, read as JSON."""
    cmd = [sys.executable, script, "--child", name, *extra]
    for flag in (*flags, "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    done = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not line:
        sys.exit(f"{name} failed:\n{done.stderr[-4000:]}")
    return json.loads(line[-1].removeprefix("RESULT "))


def common_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of every side-by-side with TRL, and the hidden ones its children get."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    sizes = {"rows": 400, "steps": 12, "batch-size": 8, "max-length": 256, "hidden": 64}
    for flag, default in {**sizes, "layers": 2, "threads": 1, "repeats": 3}.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    for hidden in ("child", "model", "workdir"):
        parser.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    return parser


def print_results(results: dict[str, dict[str, float]], against: dict[str, str]) -> None:
    """The contenders' medians, then each llmtrain mode's ratios to the TRL run ``against``
    names for it (goal: tokens/s >= 1.0x at peak RSS <= 1.0x)."""
    header = ("run", "tokens/s", "peak RSS MB", "real frac", "tokens", "last loss")
    print("{:<17} {:>9} {:>12} {:>10} {:>8} {:>10}".format(*header))
    for name, r in results.items():
        print(
            f"{name:<17} {r['tok_s']:>9.0f} {r['peak_mb']:>12.0f} {r['fraction']:>10.3f} "
            f"{r['tokens']:>8.0f} {r['loss']:>10.4f}"
        )
    for mode, trl in against.items():
        ours, theirs = results[f"llmtrain-{mode}"], results[trl]
        speed = ours["tok_s"] / theirs["tok_s"]
        memory = ours["peak_mb"] / theirs["peak_mb"]
        ok = "PASS" if speed >= 1.0 and memory <= 1.0 else "FAIL"
        print(f"llmtrain-{mode} / {trl}: tokens/s {speed:.2f}x, peak RSS {memory:.2f}x  [{ok}]")


def main() -> None:
    parser = common_parser(__doc__)
    parser.add_argument("--packed-rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from transformers import AutoTokenizer

    from llmtrain.testing import tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    try:
        model = tiny_model(workdir / "model", hidden_size=args.hidden, num_layers=args.layers)
        tok = AutoTokenizer.from_pretrained(model)
        lengths = [
            len(tok(TEMPLATE.replace("{X}", x).replace("{Y}", y)).input_ids) + 1
            for _, x, y in make_rows(args.rows)
        ]
        mean = sum(min(n, args.max_length) for n in lengths) / len(lengths)
        packed_rows = max(1, round(args.batch_size * args.max_length / mean))
        names = ["llmtrain-padded", "trl-padded", "llmtrain-packed", "trl-packed"]

        def run(name: str, i: int) -> dict[str, Any]:
            cmd = [sys.executable, __file__, "--child", name, "--model", str(model)]
            cmd += ["--workdir", str(workdir / f"round{i}"), "--packed-rows", str(packed_rows)]
            for flag in ("rows", "steps", "batch_size", "max_length", "threads"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            (workdir / f"round{i}").mkdir(exist_ok=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            return json.loads(line[-1].removeprefix("RESULT "))

        results = median_rounds(names, args.repeats, run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"tiny Llama hidden {args.hidden} x {args.layers} layers, {args.steps} steps, batch "
        f"{args.batch_size}, max_length {args.max_length}, {args.threads} thread(s), median of "
        f"{args.repeats} rounds; packed "
        f"llmtrain: {packed_rows} rows/step, budget {args.batch_size * args.max_length} tokens"
    )
    print_results(results, {mode: f"trl-{mode}" for mode in ("padded", "packed")})


if __name__ == "__main__":
    main()
