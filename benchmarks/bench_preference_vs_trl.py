"""llmtrain's DPO and KTO against TRL's DPOTrainer and KTOTrainer, side by side, packing off
and on:

    python benchmarks/bench_preference_vs_trl.py [--objective dpo|kto] [--rows 400]
        [--steps 12] [--batch-size 8] [--max-length 256] [--hidden 64] [--layers 2]
        [--repeats 3]

The same tiny random Llama (``llmtrain.testing.tiny_model``), the same preference pairs (the
synthetic rows of ``bench_vs_trl.py``: a row's prompt, its answer as ``chosen`` and the answer
of the row half the table away as ``rejected``; answers cut at a word boundary so that every
prompt + answer + EOS fits ``max_length``: neither side truncates, and they truncate
differently), a SQLite table for llmtrain and a prompt/chosen/rejected ``datasets.Dataset`` for
TRL, the prompt rendered with the same template. The same recipe on both sides: LoRA r=8,
alpha 16, dropout 0 on all attention and MLP projections; AdamW (lr 2e-4, linear schedule, no
warmup, clipping at 1.0), full precision, no gradient checkpointing; DPO with beta 0.1 and the
sigmoid loss; the reference is the model with its adapter disabled (TRL's default for a PEFT
model with ``ref_model=None``), computed in each step (``precompute_ref_log_probs`` off); the
same number of optimizer steps of ``batch_size`` pairs each (a chosen and a rejected sequence
a pair), the rows read in key order on both sides (no shuffle: the same pairs in every step).

* padded: ``batch_size`` pairs a step, right-padded, on both sides;
* packed: llmtrain packs each step's ``2 x batch_size`` sequences padding-free into rows of
  ``max_length`` (position ids; no cross-attention). TRL's ``padding_free=True`` is probed
  first: TRL 1.16 warns and falls back to padding, so its packed contender is then left out
  and llmtrain-packed is compared with trl-padded (TRL's only mode).

Each contender runs in its own subprocess (one torch thread: the machine is shared), which
reports: real tokens/s (non-padding tokens of the chosen and rejected sequences fed to the
policy over the training loop's time: TRL from ``on_train_begin`` to ``on_train_end``, after
its tokenization; llmtrain's ``tokens_per_s`` metric, which includes reading and tokenizing
the rows), the peak RSS of the process, the real-token fraction of the positions fed to the
model and the loss of the last step (the same pairs a step on both sides: the losses should
agree closely; both start at log 2). Every contender runs ``--repeats`` times, the order
rotating each round, and the medians are shown (the machine these ran on is shared and
noisy). Ratios are llmtrain / TRL.

``--objective kto``: row ``i`` of the pairs becomes (prompt, its chosen answer, liked) for
even ``i`` and (prompt, its rejected answer, disliked) for odd, so the label counts are equal
and llmtrain's default weights are TRL's (1, 1); beta 0.1, KL estimate on. Both sides pair
each prompt with the answer of the row before it in its batch for the KL term (TRL under no
grad, llmtrain in the policy's one packed forward), so the tokens counted are those of the
(prompt, answer) rows trained, the same on both sides, over each side's loop time.
TRL's KTOTrainer has no padding-free mode: llmtrain-packed is compared with trl-padded.
Goal: tokens/s >= 1.0x at peak RSS <= 1.0x TRL's, packing on and off.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# the SFT benchmark's rows, recipe and helpers (it also puts the repository on sys.path)
from bench_vs_trl import (  # noqa: E402
    LLAMA_TARGETS,
    LORA_ALPHA,
    LORA_R,
    LR,
    SAME,
    TEMPLATE,
    _peak_mb,
    common_parser,
    make_rows,
    median_rounds,
    print_results,
    run_script,
    timed_train,
)

BETA = 0.1
PROMPT = TEMPLATE.replace("{Y}", "")  # what TRL gets as the prompt; llmtrain renders the same


def make_pairs(n: int, tokenizer: Any, max_length: int) -> tuple[list[dict[str, Any]], int]:
    """``n`` (id, prompt, chosen, rejected) rows from the synthetic rows: ``rejected`` is
    another row's answer. Answers lose words from the end until BOS + prompt + answer + EOS
    fits ``max_length`` (a margin of 2 tokens for a boundary merged differently); returns the
    rows and how many answers were cut."""
    rows, cut = make_rows(n), 0

    def fit(x: str, y: str) -> str:
        nonlocal cut
        words = y.removesuffix(".").split()
        while words:
            text = TEMPLATE.replace("{X}", x).replace("{Y}", " ".join(words) + ".")
            if len(tokenizer(text).input_ids) + 1 <= max_length - 2:
                break
            words.pop()
        if len(words) < len(y.removesuffix(".").split()):
            cut += 1
        if not words:
            raise SystemExit(f"a prompt fills max_length={max_length}: raise it")
        return " ".join(words) + "."

    pairs = []
    for i, x, y in rows:
        j = (i + n // 2) % n
        while rows[j][2] == y and j != i:  # an answer that differs
            j = (j + 1) % n
        pairs.append({"id": i, "prompt": x, "chosen": fit(x, y), "rejected": fit(x, rows[j][2])})
    return pairs, cut


def feedback(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """KTO's rows from the pairs: the chosen answer liked (even ids), the rejected disliked."""
    return [
        {
            "id": p["id"],
            "prompt": p["prompt"],
            "answer": p["rejected" if p["id"] % 2 else "chosen"],
            "liked": int(p["id"] % 2 == 0),
        }
        for p in pairs
    ]


def run_llmtrain(args: argparse.Namespace, packing: bool) -> dict[str, Any]:
    import sqlite3

    import llmtrain as lt
    from llmtrain.training import run as run_module

    folder = Path(args.workdir)
    pairs = json.loads(Path(args.pairs).read_text())
    rows = feedback(pairs) if args.objective == "kto" else pairs
    columns = list(rows[0])
    con = sqlite3.connect(folder / "pairs.db")
    con.execute(f"CREATE TABLE pairs (id INTEGER PRIMARY KEY, {', '.join(columns[1:])})")
    con.executemany(
        f"INSERT INTO pairs VALUES ({', '.join('?' for _ in columns)})",
        [tuple(r[c] for c in columns) for r in rows],
    )
    con.commit()
    con.close()
    positions = {"n": 0}
    to_device = run_module.to_device

    def counted(batch: dict[str, Any], device: Any) -> dict[str, Any]:
        positions["n"] += batch["input_ids"].numel()  # once a micro-batch: the policy's forward
        return to_device(batch, device)

    run_module.to_device = counted  # type: ignore[assignment]
    trainer = lt.LLMTrainer(
        f"{args.objective}-bench-{packing}",
        model=args.model,
        objective=args.objective,
        beta=BETA,
        prompt_template=TEMPLATE,
        max_length=args.max_length,
        batch_size=args.batch_size,
        learning_rate=LR,
        max_steps=args.steps,
        **SAME,
        packing=packing,
    )
    db = lt.connect(f"sqlite:///{folder / 'pairs.db'}", artifacts=folder / "artifacts")
    fields = (
        {"Y": "answer", "label": "liked"}
        if args.objective == "kto"
        else {"chosen": "chosen", "rejected": "rejected"}
    )
    model = trainer.fit(X="prompt", db=db, select=lt.Table("pairs"), **fields)
    last = db.metadata.get_metrics(model.record.run_id)[-1].values
    return {
        "tok_s": last["tokens_per_s"],
        "tokens": last["tokens"],
        "seconds": last["tokens"] / last["tokens_per_s"],
        "fraction": last["tokens"] / max(positions["n"], 1),
        "loss": last["loss"],
        "peak_mb": _peak_mb(),
    }


def trl_trainer(args: argparse.Namespace, padding_free: bool, callbacks: list[Any]) -> Any:
    """TRL's DPOTrainer (KTOTrainer) on the same pairs (feedback rows) and recipe."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl_recipe import trl_lora

    pairs = json.loads(Path(args.pairs).read_text())
    kto = args.objective == "kto"
    if kto:
        rows = [
            {
                "prompt": PROMPT.replace("{X}", r["prompt"]),
                "completion": r["answer"],
                "label": bool(r["liked"]),
            }
            for r in feedback(pairs)
        ]
    else:
        rows = [
            {
                "prompt": PROMPT.replace("{X}", p["prompt"]),
                "chosen": p["chosen"],
                "rejected": p["rejected"],
            }
            for p in pairs
        ]
    common = {
        "output_dir": str(Path(args.workdir) / "trl"),
        "max_steps": args.steps,
        "per_device_train_batch_size": args.batch_size,
        "learning_rate": LR,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "optim": "adamw_torch",
        "max_length": args.max_length,
        "beta": BETA,
        "precompute_ref_log_probs": False,
        "train_sampling_strategy": "sequential",  # key order, as llmtrain with shuffle=False
        "gradient_checkpointing": False,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    if kto:
        config: Any = KTOConfig(**common, desirable_weight=1.0, undesirable_weight=1.0)
    else:
        config = DPOConfig(**common, padding_free=padding_free, loss_type=["sigmoid"])
    lora = trl_lora(LORA_R, LORA_ALPHA, LLAMA_TARGETS)
    return (KTOTrainer if kto else DPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
        ref_model=None,  # with a PEFT model: the reference is the adapter disabled
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        peft_config=lora,
        callbacks=callbacks,
    )


def probe_trl_padding_free(args: argparse.Namespace) -> dict[str, Any]:
    """Whether TRL's DPOTrainer honours ``padding_free=True`` here (1.16: warns, pads)."""
    try:
        trainer = trl_trainer(args, True, [])
    except Exception as exc:  # reported, not raised: TRL then runs padded
        return {"honoured": False, "why": f"{type(exc).__name__}: {exc}"[:300]}
    honoured = bool(getattr(trainer, "padding_free", False))
    why = "" if honoured else "DPOTrainer warns that it is temporarily unavailable and pads"
    return {"honoured": honoured, "why": why}


def run_trl(args: argparse.Namespace, packing: bool) -> dict[str, Any]:
    def make(callbacks: list[Any]) -> Any:
        trainer = trl_trainer(args, packing, callbacks)
        if packing and not trainer.padding_free:
            raise SystemExit("TRL fell back to padding: trl-packed would be trl-padded again")
        return trainer

    # the LlamaModel inside the PEFT wrapper; the reference's forward runs without grad
    found = timed_train(make, lambda trainer: trainer.model.get_base_model().model)
    return found | {"seconds": found["tokens"] / found["tok_s"]}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "trl-probe" and args.objective == "kto":
        why = "KTOTrainer has no padding-free mode"
        print("RESULT " + json.dumps({"honoured": False, "why": why}))
        return
    if args.child == "trl-probe":
        print("RESULT " + json.dumps(probe_trl_padding_free(args)))
        return
    side, mode = args.child.split("-")
    fn = run_llmtrain if side == "llmtrain" else run_trl
    print("RESULT " + json.dumps(fn(args, mode == "packed")))


def run_child(name: str, args: argparse.Namespace, model: Path, pairs: Path, folder: Path) -> Any:
    folder.mkdir(parents=True, exist_ok=True)
    extra = ("--model", str(model), "--workdir", str(folder), "--pairs", str(pairs))
    flags = ("objective", "steps", "batch_size", "max_length")
    return run_script(__file__, name, args, flags, *extra)


def main() -> None:
    parser = common_parser(__doc__)
    parser.add_argument("--objective", choices=["dpo", "kto"], default="dpo")
    parser.add_argument("--pairs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.rows < args.steps * args.batch_size:
        sys.exit(f"--rows {args.rows} < steps x batch-size: an epoch would end mid-run")

    from transformers import AutoTokenizer

    from llmtrain.testing import tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="bench-dpo-vs-trl-"))
    try:
        model = tiny_model(workdir / "model", hidden_size=args.hidden, num_layers=args.layers)
        pairs, cut = make_pairs(args.rows, AutoTokenizer.from_pretrained(model), args.max_length)
        pairs_file = workdir / "pairs.json"
        pairs_file.write_text(json.dumps(pairs))
        probe = run_child("trl-probe", args, model, pairs_file, workdir / "probe")
        names = ["llmtrain-padded", "trl-padded", "llmtrain-packed"]
        if probe["honoured"]:
            names.append("trl-packed")
        results = median_rounds(
            names,
            args.repeats,
            lambda name, i: run_child(name, args, model, pairs_file, workdir / f"round{i}" / name),
        )
        if args.objective == "kto":  # the rows trained, the same on both sides, by each's time
            tokenizer = AutoTokenizer.from_pretrained(model)
            trained = feedback(pairs)[: args.steps * args.batch_size]
            texts = [TEMPLATE.replace("{X}", r["prompt"]) for r in trained]
            texts = [t.replace("{Y}", r["answer"]) for t, r in zip(texts, trained)]
            tokens = sum(len(tokenizer(t).input_ids) + 1 for t in texts)  # + EOS
            for r in results.values():
                r["tokens"], r["tok_s"] = tokens, tokens / r["seconds"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"{args.objective.upper()} (beta {BETA}), tiny Llama hidden {args.hidden} x "
        f"{args.layers} layers, "
        f"{args.steps} steps of {args.batch_size} pairs, max_length {args.max_length} "
        f"({cut} of {2 * args.rows} answers cut to fit), {args.threads} thread(s), median of "
        f"{args.repeats} rounds"
    )
    if not probe["honoured"]:
        print(f"TRL padding_free=True: not honoured ({probe['why']}); TRL runs padded only")
    packed = "trl-packed" if "trl-packed" in results else "trl-padded"  # TRL's only mode
    print_results(results, {"padded": "trl-padded", "packed": packed})


if __name__ == "__main__":
    main()
