"""Training throughput of LLMTrainer against a bare PyTorch loop and transformers.Trainer.

    python benchmarks/bench_trainer.py [--hidden 256] [--layers 4] [--rows 3000] [--steps 20]
                                       [--batch-size 8] [--max-length 256] [--repeats 3]
                                       [--threads 1] [--no-hf] [--no-lockstep] [--profile]

A tiny random Llama (``llmtrain.testing.tiny_model``, built once into a temp folder) and a
SQLite table ``docs(id, instruction, output)`` of ``--rows`` rows of varied length. In ONE
process, round after round (the order rotating each round, since the machine is noisy):

* **llmtrain**: ``FitRun.setup()`` then ``FitRun.train()``, the very code ``LLMTrainer.fit``
  runs (LoRA, ``max_steps``, batch size B, no packing): rows are streamed from SQLite,
  formatted and collated inside the timed loop. Train-loop time only (setup is timed
  apart); tokens are the run's non-padding input tokens (``FitRun.tokens_seen``, what the
  ``tokens`` metric records). The run's own ``tokens_per_s`` metric is shown next to it.
* **bare PyTorch**: the SAME batches (every row formatted up front with our ``Formatter`` and
  ``pad_collate``, batched in the order llmtrain reads them; checked equal to llmtrain's),
  the same model, PEFT LoRA config, AdamW, linear schedule, clipping, batch size and steps;
  loss = summed CE / target tokens. Nothing but forward/backward/step in the timed loop.
* **transformers.Trainer**: the same examples in the same order (a plain torch Dataset,
  sequential sampler), same model/LoRA/optimizer/schedule/batch size/steps; no eval, no
  saving, ``report_to=[]``, ``disable_tqdm=True``. Timed from ``on_train_begin`` to
  ``on_train_end``.
* **llmtrain + packing**: the same trainer with ``packing=True``; its real batches give the
  measured non-padding fraction.
* **lockstep** (``llmtrain+bare``, ``hf+bare``): llmtrain, and HF, each run with a bare loop
  interleaved step by step (one bare step before each of theirs, timed apart), so a burst of
  load from other processes hits both sides alike: the least noisy ratio on a busy machine.

One torch thread by default: on a shared 2-core machine two OpenMP threads spin against the
other processes and a step time swings 10x (``--threads 2`` on an idle machine).

The medians (and bests) over the rounds are reported; the ratios are given as the ratio of
the medians, the median of the per-round ratios, the ratio of the bests and the lockstep
median; the PASS/FAIL verdict uses lockstep (else the medians). Goals: llmtrain / bare >= 0.9,
llmtrain / HF > 1, non-padding fraction with packing >= 0.95 (with a sweep of batch size and
max_length when the default does not reach it).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import gc
import io
import math
import os
import pstats
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import synthetic_rows  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import llmtrain as lt  # noqa: E402
from llmtrain.db.keys import key_repr  # noqa: E402
from llmtrain.formatting import IGNORE_INDEX, Formatter, pack_examples, pad_collate  # noqa: E402
from llmtrain.testing import tiny_model  # noqa: E402
from llmtrain.training.run import FitRun  # noqa: E402
from llmtrain.training.strategies import make_strategy  # noqa: E402


@dataclass(frozen=True)
class PaddingEfficiency:
    """Fractions of real (non-padding) tokens in the batches each strategy would build."""

    padded: float
    packed: float
    tokens: int


def padding_efficiency(examples: Any, max_length: int, *, batch_size: int) -> PaddingEfficiency:
    """Padding against packing over ``examples``, ``batch_size`` at a time."""
    tokens = sum(map(len, examples))
    padded = packed = 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        padded += len(batch) * max(map(len, batch))
        rows = pack_examples(batch, max_length)
        packed += len(rows) * max(sum(map(len, r)) for r in rows)
    return PaddingEfficiency(tokens / max(padded, 1), tokens / max(packed, 1), tokens)


TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
X, Y, TABLE = "instruction", "output", "docs"
GOAL_BARE, GOAL_HF, GOAL_PACKED = 0.9, 1.0, 0.95
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_WORDS = (
    "model",
    "data",
    "table",
    "row",
    "column",
    "query",
    "index",
    "token",
    "train",
    "epoch",
    "batch",
    "learning",
    "rate",
    "loss",
    "gradient",
    "layer",
    "weight",
    "adapter",
    "rank",
    "shard",
    "worker",
    "window",
    "cache",
    "key",
    "order",
    "seed",
    "shuffle",
    "prompt",
    "answer",
    "question",
    "explain",
    "summarise",
    "translate",
    "list",
    "compare",
    "describe",
    "write",
    "short",
    "long",
    "simple",
    "clear",
    "python",
    "sql",
    "database",
    "stream",
    "memory",
    "disk",
    "network",
    "fast",
    "slow",
    "small",
    "large",
    "first",
    "last",
    "next",
    "every",
    "each",
    "other",
    "same",
    "new",
    "old",
    "good",
    "best",
    "time",
    "value",
    "number",
    "text",
    "word",
)
_VERBS = ("Explain", "Summarise", "Describe", "List", "Compare", "Translate", "Rewrite")


# -- setup -----------------------------------------------------------------------------------
def make_rows(n: int, seed: int = 0) -> list[tuple[int, str, str]]:
    """Short to long prompts, and answers with a long tail (log-normal word counts)."""
    return synthetic_rows.make_rows(n, seed, _WORDS, verbs=_VERBS)


def make_database(folder: Path, rows: int) -> str:
    path = folder / "bench.db"
    con = sqlite3.connect(path)
    con.execute(f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, {X} TEXT, {Y} TEXT)")
    con.executemany(f"INSERT INTO {TABLE} VALUES (?, ?, ?)", make_rows(rows))
    con.commit()
    con.close()
    return f"sqlite:///{path}"


def read_rows(uri: str) -> list[tuple[Any, dict[str, str]]]:
    con = sqlite3.connect(uri.removeprefix("sqlite:///"))
    out = [
        (k, {X: x, Y: y})
        for k, x, y in con.execute(f"SELECT id, {X}, {Y} FROM {TABLE} ORDER BY id")
    ]
    con.close()
    return out


def make_trainer(args: argparse.Namespace, name: str, **extra: Any) -> lt.LLMTrainer:
    options: dict[str, Any] = {
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": args.lr,
        "lora_r": args.lora_r,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "max_length": args.max_length,
        "progress_bar": args.progress_bar,
        "seed": args.seed,
    }
    options.update(extra)
    return lt.LLMTrainer(name, model=str(args.model_path), prompt_template=TEMPLATE, **options)


def new_run(trainer: lt.LLMTrainer, db: Any) -> FitRun:
    """A FitRun exactly as ``LLMTrainer.fit`` builds one: registered, then set up by the
    executor."""
    from llmtrain.config.args import TrainerConfig, build
    from llmtrain.running.register import register

    spec = trainer._fit_spec(X, Y, db, lt.Table(TABLE), None)
    config = build(TrainerConfig, {**trainer.config.model_dump(), "fit": spec.model_dump()})
    plan = register(
        db, config, None, resume=False, allow_changed_data=True, incremental=False, callbacks=()
    )
    return FitRun(plan, db, make_strategy("single"))


def release() -> None:
    gc.collect()


# -- contenders ------------------------------------------------------------------------------
def run_llmtrain(
    trainer: lt.LLMTrainer,
    db: Any,
    *,
    spy: bool = False,
    companion: Callable[[], Companion] | None = None,
    profile: cProfile.Profile | None = None,
) -> dict[str, Any]:
    """Setup, then the timed ``FitRun.train()``. ``spy`` records (real tokens, tensor cells)
    of every batch the loop trains on; ``companion`` interleaves a bare loop step by step
    (its time is subtracted)."""
    run = new_run(trainer, db)
    seen: list[tuple[int, int]] = []
    partner = None
    try:
        t0 = time.perf_counter()
        run.setup()
        setup_s = time.perf_counter() - t0
        if spy or companion is not None:
            partner = companion() if companion is not None else None
            epochs = run.batches.epochs

            def hooked(*a: Any, **k: Any) -> Any:
                for epoch, batch in epochs(*a, **k):
                    if spy:
                        seen.append((int(batch["num_tokens"]), batch["input_ids"].numel()))
                    if partner is not None:
                        partner.step()
                    yield epoch, batch

            run.batches.epochs = hooked  # type: ignore[method-assign]
        t0 = time.perf_counter()
        with profile if profile is not None else contextlib.nullcontext():
            run.train()
        train_s = time.perf_counter() - t0 - (partner.seconds if partner else 0.0)
        metrics = db.metadata.get_metrics(run.run_id)
        return {
            "train_s": train_s,
            "setup_s": setup_s,
            "tokens": run.tokens_seen,
            "losses": [h["loss"] for h in run.history],
            "metric_tok_s": metrics[-1].values["tokens_per_s"] if metrics else math.nan,
            "batches": seen,
            "partner": partner.result() if partner else None,
        }
    finally:
        run.cleanup()
        del run
        partner = None
        release()


def load_peft_model(args: argparse.Namespace) -> Any:
    """The model as a plain script would build it: from_pretrained + PEFT LoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmtrain.training.run import seed_everything

    seed_everything(args.seed)  # as FitRun.setup does, so the LoRA init matches
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=LLAMA_TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


class BareLoop:
    """The plain loop: forward, summed CE / target tokens, backward, clip, AdamW, schedule."""

    def __init__(self, args: argparse.Namespace, total_steps: int) -> None:
        from transformers import get_scheduler

        self.model = load_peft_model(args)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        self.scheduler = get_scheduler(
            "linear", self.optimizer, num_warmup_steps=0, num_training_steps=total_steps
        )
        self.model.train()

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        logits = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        count = batch["num_target_tokens"].clamp(min=1)
        (loss / count).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item() / count.item()


def run_bare(args: argparse.Namespace, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    loop = BareLoop(args, len(batches))
    setup_s = time.perf_counter() - t0
    losses, tokens = [], 0
    t0 = time.perf_counter()
    for batch in batches:
        losses.append(loop.step(batch))
        tokens += int(batch["attention_mask"].sum())
    train_s = time.perf_counter() - t0
    del loop
    release()
    return {"train_s": train_s, "setup_s": setup_s, "tokens": tokens, "losses": losses}


class Companion:
    """A bare loop run in lockstep with another trainer: one bare step before each of its
    steps, timed apart, so a burst of load on the machine hits both alike."""

    def __init__(self, args: argparse.Namespace, batches: list[dict[str, torch.Tensor]]) -> None:
        self.loop = BareLoop(args, len(batches))
        self.batches = iter(batches)
        self.seconds, self.tokens = 0.0, 0

    def step(self) -> None:
        batch = next(self.batches, None)
        if batch is None:
            return
        t0 = time.perf_counter()
        self.loop.step(batch)
        self.seconds += time.perf_counter() - t0
        self.tokens += int(batch["attention_mask"].sum())

    def result(self) -> dict[str, Any]:
        return {"train_s": self.seconds, "tokens": self.tokens}


class _ExampleDataset(torch.utils.data.Dataset):
    def __init__(self, examples: list[Any]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Any:
        return self.examples[i]


def run_hf(
    args: argparse.Namespace,
    examples: list[Any],
    pad_id: int,
    workdir: Path,
    *,
    companion: Callable[[], Companion] | None = None,
) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class InOrder(Trainer):  # the same batches as the others: no shuffling
        def _get_train_sampler(self, *a: Any, **k: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    class Clock(TrainerCallback):
        begin = end = 0.0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            Clock.begin = time.perf_counter()

        def on_train_end(self, *a: Any, **k: Any) -> None:
            Clock.end = time.perf_counter()

    class Lockstep(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if partner is not None:
                partner.step()

    tokens = 0

    def collate(batch: list[Any]) -> dict[str, torch.Tensor]:
        nonlocal tokens
        out = pad_collate(batch, pad_id)
        del out["num_target_tokens"]
        tokens += int(out["attention_mask"].sum())
        return out

    t0 = time.perf_counter()
    model = load_peft_model(args)
    targs = TrainingArguments(
        output_dir=str(workdir / "hf"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        seed=args.seed,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        logging_steps=max(args.steps, 1),
    )
    trainer = InOrder(
        model=model,
        args=targs,
        train_dataset=_ExampleDataset(examples),
        data_collator=collate,
        callbacks=[Clock(), Lockstep()],
    )
    setup_s = time.perf_counter() - t0
    partner = companion() if companion is not None else None
    with contextlib.redirect_stdout(io.StringIO()):  # its end-of-training log line
        trainer.train()
    train_s = Clock.end - Clock.begin - (partner.seconds if partner else 0.0)
    result = {
        "train_s": train_s,
        "setup_s": setup_s,
        "tokens": tokens,
        "partner": partner.result() if partner else None,
    }
    del trainer, model
    partner = None
    release()
    return result


# -- the reference batches -------------------------------------------------------------------
def reference(args: argparse.Namespace, db: Any) -> dict[str, Any]:
    """The order llmtrain reads the rows in (a dry pass of the real loader), and the same
    batches built up front from rows formatted with our Formatter and pad_collate."""
    run = new_run(make_trainer(args, "bench-dry"), db)
    run.setup()
    try:
        epoch0: list[list[str]] = []
        loaded: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for epoch, batch in run.batches.epochs(0, None):
            if epoch == 0:
                epoch0.append(batch["keys"])
            if len(loaded) < args.steps:
                loaded.append(batch)
                if len(loaded) == args.steps:  # llmtrain's data path for one run, no model
                    data_s = time.perf_counter() - t0
            if epoch > 0 and len(loaded) >= args.steps:
                break
        tokenizer = run.tokenizer
    finally:
        run.cleanup()
    formatter = Formatter(tokenizer, TEMPLATE, max_length=args.max_length, x_field=X, y_field=Y)
    rows = read_rows(args.uri)
    t0 = time.perf_counter()
    by_key = {key_repr(e.key): e for e in formatter.format_batch(rows, source=TABLE)}
    format_s = time.perf_counter() - t0
    batches, flat = [], []
    for ref in loaded:
        examples = [by_key[k] for k in ref["keys"]]
        batch = pad_collate(examples, tokenizer.pad_token_id)
        for name in ("input_ids", "labels", "attention_mask", "num_target_tokens"):
            if not torch.equal(batch[name], ref[name]):
                raise AssertionError(f"pre-tokenized batch differs from llmtrain's in {name}")
        batches.append(batch)
        flat.extend(examples)
    return {
        "batches": batches,
        "examples": flat,
        "pad_id": tokenizer.pad_token_id,
        "epoch_order": [by_key[k] for keys in epoch0 for k in keys],
        "tokenizer": tokenizer,
        "rows": rows,
        "format_s": format_s,
        "truncated": sum(e.truncated for e in by_key.values()),
        "data_s": data_s,
    }


# -- reporting -------------------------------------------------------------------------------
def tok_s(r: dict[str, Any]) -> float:
    return r["tokens"] / r["train_s"]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def packing_sweep(
    args: argparse.Namespace, tokenizer: Any, rows: list[Any], order: list[Any]
) -> list[tuple[int, int, float, float]]:
    """(max_length, batch size, padded, packed) over one epoch of rows in loader order,
    formatted (truncated) at each max_length as a trainer with that max_length would."""
    keyed = {key_repr(k): (k, r) for k, r in rows}
    ordered_rows = [keyed[key_repr(e.key)] for e in order]
    out = []
    for max_length in sorted({args.max_length, 512, 1024, 2048}):
        formatter = Formatter(tokenizer, TEMPLATE, max_length=max_length, x_field=X, y_field=Y)
        examples = formatter.format_batch(ordered_rows, source=TABLE)
        for size in sorted({args.batch_size, 16, 32, 64, 128, 256}):
            eff = padding_efficiency(examples, max_length, batch_size=size)
            out.append((max_length, size, eff.padded, eff.packed))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="rounds of alternating runs")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a 2-core machine that also runs other "
        "work, 2 OpenMP threads spin against it and a step swings 10x; 0 keeps "
        "torch's default)",
    )
    p.add_argument("--progress-bar", action="store_true", help="llmtrain with its tqdm bar")
    p.add_argument("--no-hf", action="store_true", help="skip transformers.Trainer")
    p.add_argument("--no-packing", action="store_true", help="skip the packed fits")
    p.add_argument(
        "--no-lockstep",
        action="store_true",
        help="skip the lockstep rounds (each trainer interleaved with a bare loop)",
    )
    p.add_argument(
        "--pack-steps",
        type=int,
        default=5,
        help="steps of a packed fit at a setting of the sweep that reaches 0.95",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile one llmtrain FitRun.train() and print the top entries",
    )
    args = p.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = Path(tempfile.gettempdir()) / "llmtrain_bench_trainer"
    args.model_path = tiny_model(
        cache / f"tiny_llama_h{args.hidden}_l{args.layers}",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
    )
    work = Path(tempfile.mkdtemp(prefix="llmtrain-bench-trainer-"))
    atexit.register(shutil.rmtree, work, True)  # the database, artifacts and HF output
    args.uri = make_database(work, args.rows)
    db = lt.connect(args.uri, artifacts=work / "artifacts")
    load_before = os.getloadavg()[0]
    print(
        f"model: tiny llama hidden={args.hidden} layers={args.layers} heads={args.heads}; "
        f"{args.rows:,} rows in SQLite; B={args.batch_size}, steps={args.steps}, "
        f"max_length={args.max_length}, LoRA r={args.lora_r} dropout={args.lora_dropout}; "
        f"torch threads {torch.get_num_threads()}; {args.repeats} rounds",
        flush=True,
    )

    ref = reference(args, db)
    lengths = sorted(len(e) for e in ref["epoch_order"])
    print(
        f"examples: {len(lengths):,}, tokens min/median/mean/max = {lengths[0]}/"
        f"{lengths[len(lengths) // 2]}/{statistics.mean(lengths):.0f}/{lengths[-1]} "
        f"({ref['truncated']} truncated at {args.max_length}); formatting every row up "
        f"front took {ref['format_s']:.2f}s",
        flush=True,
    )

    # warm-up, and the end-to-end check: one real LLMTrainer.fit() and its recorded metrics
    t0 = time.perf_counter()
    make_trainer(args, "bench-fit").fit(X=X, Y=Y, db=db, select=lt.Table(TABLE))
    fit_wall = time.perf_counter() - t0
    (fit_run,) = db.metadata.list_runs("trainer", "bench-fit")
    fit_metric = db.metadata.get_metrics(fit_run.run_id)[-1].values
    release()

    def partner() -> Companion:
        return Companion(args, ref["batches"])

    contenders: dict[str, Callable[[], dict[str, Any]]] = {
        "llmtrain": lambda: run_llmtrain(make_trainer(args, "bench-ours"), db),
        "bare": lambda: run_bare(args, ref["batches"]),
    }
    if not args.no_hf:
        contenders["hf"] = lambda: run_hf(args, ref["examples"], ref["pad_id"], work)
    if not args.no_packing:
        contenders["packed"] = lambda: run_llmtrain(
            make_trainer(args, "bench-packed", packing=True), db, spy=True
        )
    if not args.no_lockstep:
        contenders["llmtrain+bare"] = lambda: run_llmtrain(
            make_trainer(args, "bench-lockstep"), db, companion=partner
        )
        if not args.no_hf:
            contenders["hf+bare"] = lambda: run_hf(
                args, ref["examples"], ref["pad_id"], work, companion=partner
            )
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            out = contenders[name]()
            results[name].append(out)
            extra = (
                f"  | bare in lockstep {tok_s(out['partner']):,.0f} tok/s"
                if out.get("partner")
                else ""
            )
            print(
                f"  round {r + 1}: {name:14s} {tok_s(out):>9,.0f} tok/s "
                f"({out['train_s']:.2f}s){extra}",
                flush=True,
            )
    load_after = os.getloadavg()[0]

    # consistency: the same tokens, and (same seed, same batches) the same losses
    ours, bare = results["llmtrain"], results["bare"]
    tokens = bare[0]["tokens"]
    for name, runs in results.items():
        if name != "packed":
            assert all(x["tokens"] == tokens for x in runs), f"{name}: token count differs"
    loss_gap = max(abs(a - b) for a, b in zip(ours[0]["losses"], bare[0]["losses"]))

    med = {name: statistics.median(tok_s(x) for x in runs) for name, runs in results.items()}
    best = {name: max(tok_s(x) for x in runs) for name, runs in results.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(tok_s(x) / tok_s(y) for x, y in zip(results[a], results[b]))

    def lockstep(name: str) -> float:  # median over rounds of trainer / its bare partner
        return statistics.median(tok_s(x) / tok_s(x["partner"]) for x in results[name])

    width = 96
    print()
    print("TRAIN LOOP THROUGHPUT (non-padding input tokens / train-loop seconds; setup excluded)")
    print(f"{'':40s} {'median':>9s} {'best':>9s}   {'each round':26s} {'setup s':>7s}")
    print("-" * width)
    labels = [
        ("llmtrain FitRun.train, padded", "llmtrain"),
        ("bare PyTorch loop, same batches", "bare"),
        ("transformers.Trainer, same batches", "hf"),
        ("llmtrain FitRun.train, packing", "packed"),
    ]
    for label, name in labels:
        if name in results:
            runs = results[name]
            each = " ".join(f"{tok_s(x):,.0f}" for x in runs)
            print(
                f"{label:40s} {med[name]:>9,.0f} {best[name]:>9,.0f}   {each:26s} "
                f"{statistics.median(x['setup_s'] for x in runs):>7.2f}"
            )
    print(
        f"{'  llmtrain metric tokens_per_s (in-loop)':40s} "
        f"{statistics.median(x['metric_tok_s'] for x in ours):>9,.0f}"
    )
    print(
        f"{'  one LLMTrainer.fit(), metric':40s} {fit_metric['tokens_per_s']:>9,.0f}"
        f"   (warm-up run; {fit_wall:.1f}s wall incl. load and save)"
    )
    step_ms = 1e3 * statistics.median(x["train_s"] for x in ours) / args.steps
    data_ms = 1e3 * ref["data_s"] / args.steps
    print(
        f"{'  llmtrain data path alone, ms/step':40s} {data_ms:>9.1f}   (SQLite -> formatted, "
        f"collated batch, no model: {100 * data_ms / step_ms:.1f}% of a {step_ms:.0f} ms "
        f"step)"
    )
    print("-" * width)
    print(
        f"{tokens:,} non-padding tokens per run in all three; max |loss llmtrain - loss "
        f"bare| over the {args.steps} steps: {loss_gap:.1e}; load average "
        f"{load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores"
    )

    print()
    print(f"{'RATIO':40s} {'medians':>9s} {'paired':>9s} {'best':>9s} {'lockstep':>9s}   goal")
    print("-" * width)

    def ratio_row(
        label: str, a: str, b: str, goal: str, ok: Callable[[float], bool], step: float | None
    ) -> None:
        value = med[a] / med[b]
        locked = f"{step:>9.3f}" if step is not None else f"{'-':>9s}"
        judged = step if step is not None else value  # the least noisy figure there is
        print(
            f"{label:40s} {value:>9.3f} {paired(a, b):>9.3f} {best[a] / best[b]:>9.3f} "
            f"{locked}   {goal}  {verdict(ok(judged))}"
        )

    lock_ours = lockstep("llmtrain+bare") if "llmtrain+bare" in results else None
    ratio_row(
        "llmtrain / bare PyTorch",
        "llmtrain",
        "bare",
        f">= {GOAL_BARE}",
        lambda v: v >= GOAL_BARE,
        lock_ours,
    )
    if "hf" in results:
        lock_hf = (
            lock_ours / lockstep("hf+bare")
            if lock_ours is not None and "hf+bare" in results
            else None
        )
        ratio_row(
            "llmtrain / transformers.Trainer",
            "llmtrain",
            "hf",
            f">  {GOAL_HF}",
            lambda v: v > GOAL_HF,
            lock_hf,
        )
    print(
        "medians: ratio of the medians; paired: median of the per-round ratios; lockstep: "
        "each\ntrainer interleaved step by step with a bare loop, median of trainer/bare "
        "(llmtrain/HF\n= (llmtrain/bare) / (HF/bare)), the least sensitive to load bursts; "
        "the verdict uses\nlockstep when it ran, else medians"
    )

    print()
    print(f"NON-PADDING FRACTION (B={args.batch_size}, max_length={args.max_length})")
    print("-" * width)
    eff = padding_efficiency(ref["epoch_order"], args.max_length, batch_size=args.batch_size)
    print(f"{'padded, padding_efficiency (one epoch)':48s} {eff.padded:.3f}")
    pad_cells = sum(b["input_ids"].numel() for b in ref["batches"])
    print(f"{f'padded, real batches of the fit ({args.steps} steps)':48s} {tokens / pad_cells:.3f}")
    print(
        f"{'packed, padding_efficiency (one epoch)':48s} {eff.packed:.3f}   goal >= "
        f"{GOAL_PACKED}  {verdict(eff.packed >= GOAL_PACKED)}"
    )
    if "packed" in results:
        seen = results["packed"][0]["batches"]
        real = sum(t for t, _ in seen) / sum(c for _, c in seen)
        print(
            f"{f'packed, real batches of a packed fit ({len(seen)} steps)':48s} "
            f"{real:.3f}   goal >= {GOAL_PACKED}  {verdict(real >= GOAL_PACKED)}"
        )

    sweep = packing_sweep(args, ref["tokenizer"], ref["rows"], ref["epoch_order"])
    sizes = sorted({size for _, size, _, _ in sweep})
    print()
    print(
        "packed fraction by max_length (rows) x batch size B, padding_efficiency over one "
        "epoch;\n(padded fraction at that max_length and B in brackets); * = reaches 0.95"
    )
    print(f"{'max_length':>10s} " + " ".join(f"{f'B={s}':>15s}" for s in sizes))
    cells = {(m, s): (pd, pk) for m, s, pd, pk in sweep}
    for max_length in sorted({m for m, _, _, _ in sweep}):
        line = []
        for size in sizes:
            padded, packed = cells[(max_length, size)]
            mark = "*" if packed >= GOAL_PACKED else " "
            line.append(f"{packed:.3f}{mark}({padded:.2f})")
        print(f"{max_length:>10d} " + " ".join(f"{c:>15s}" for c in line))
    print(
        "packed fraction = tokens / (rows x longest row); first-fit in arrival order loses "
        "the\nunfilled end of every row: it reaches 0.95 only when a batch fills many rows "
        "of a\nmax_length well above the longest example, or when a whole batch fits in one "
        "row"
    )
    # the setting to check with a real packed fit: the trainer's batch size if some
    # max_length reaches the goal with it, else the smallest max_length x B that does
    reaching = [(m, s) for (m, s), (_, pk) in cells.items() if pk >= GOAL_PACKED]
    first_ok = min(reaching, key=lambda c: (c[1] != args.batch_size, c[0] * c[1]), default=None)
    if first_ok is not None and not args.no_packing and args.pack_steps > 0:
        max_length, size = first_ok
        out = run_llmtrain(
            make_trainer(
                args,
                "bench-packed-goal",
                packing=True,
                max_length=max_length,
                batch_size=size,
                max_steps=args.pack_steps,
            ),
            db,
            spy=True,
        )
        seen = out["batches"]
        real = sum(t for t, _ in seen) / sum(c for _, c in seen)
        print(
            f"packed fit at max_length={max_length}, B={size}: real batches ({len(seen)} "
            f"steps) {real:.3f}   goal >= {GOAL_PACKED}  {verdict(real >= GOAL_PACKED)}; "
            f"{tok_s(out):,.0f} tok/s"
        )

    if args.profile:
        prof = cProfile.Profile()
        run_llmtrain(make_trainer(args, "bench-profile"), db, profile=prof)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())


if __name__ == "__main__":
    main()
