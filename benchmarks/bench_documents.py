"""Continued pre-training's data path: tokens/s against the tokenizer's own batch encode of the
same texts, and the share of a real fit's step spent waiting for its data.

    python benchmarks/bench_documents.py [--docs 4000] [--max-length 512] [--steps 30]

1. Tokens/s, side by side in one process, best of 3: ``tokenizer(texts)`` (the fast
   tokenizer's batch encode, the floor any formatting stands on) against llmtrain's collate
   of a step's rows (encode, cut into ``max_length`` windows, pack, build the tensors), on the
   same documents, a step's rows at a time. Goal: at least 0.8x.
2. Data wait: ``fit(X="body")`` of the demo's tiny model on a SQLite table of the documents
   (packing, ``batch_size`` 16), timing the loop's two halves of every step as
   ``bench_datasets.py`` does. Goal: under 2% of a step.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import llmtrain as lt  # noqa: E402
from llmtrain.testing import tiny_model  # noqa: E402

WORDS = "data base table row column key value model train token step epoch loss".split()  # noqa: SIM905


def documents(count: int, seed: int = 0) -> list[str]:
    """Documents of 20 to 2,000 words (a long tail, as real corpora have)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(int(20 * 100 ** rng.random())))
        for _ in range(count)
    ]


def tokens_per_second(model: Path, texts: list[str], max_length: int, rows: int) -> None:
    from transformers import AutoTokenizer

    from llmtrain.config.args import DataArguments
    from llmtrain.formatting import Formatter
    from llmtrain.training.batches import make_collate

    tokenizer = AutoTokenizer.from_pretrained(model)
    args = DataArguments(max_length=max_length, packing=True)
    formatter = Formatter(tokenizer, None, max_length=max_length, x_field="body")
    sdpa = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    collate = make_collate(formatter, tokenizer, sdpa, args, "docs", token_budget=rows * max_length)
    steps = [
        [(i + j, {"body": t}) for j, t in enumerate(texts[i : i + rows])]
        for i in range(0, len(texts), rows)
    ]
    total = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])

    def encode() -> None:
        for step in steps:
            tokenizer([row["body"] for _, row in step], add_special_tokens=False)

    def ours() -> None:
        for step in steps:
            collate(step)

    best: dict[str, float] = {}
    for name, call in (("tokenizer", encode), ("llmtrain", ours)) * 3:
        t0 = time.perf_counter()
        call()
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    base, mine = total / best["tokenizer"], total / best["llmtrain"]
    print(f"tokens: {total:,} in {len(texts):,} documents, {rows} a step, max_length {max_length}")
    print(f"  tokenizer batch encode   {base:>12,.0f} tokens/s")
    print(f"  llmtrain collate         {mine:>12,.0f} tokens/s   ratio {mine / base:.2f}")


def data_wait(model: Path, texts: list[str], max_length: int, steps: int, folder: Path) -> None:
    from bench_datasets import timed_calls, timing

    from llmtrain.training import run as run_module
    from llmtrain.training.batches import TrainBatches

    path = folder / "docs.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT)")
        conn.executemany("INSERT INTO docs VALUES (?, ?)", enumerate(texts))
    fit_run = run_module.FitRun
    train_step, make_steps = fit_run._train_step, TrainBatches.steps
    data: list[float] = []
    train: list[float] = []

    fit_run._train_step = timed_calls(train_step, train)  # type: ignore[method-assign]
    TrainBatches.steps = timing(make_steps, data)  # type: ignore[method-assign]
    try:
        db = lt.connect(f"sqlite:///{path}", artifacts=folder / "artifacts")
        trainer = lt.LLMTrainer(
            "bench-docs",
            model=str(model),
            max_steps=steps,
            batch_size=16,
            max_length=max_length,
            packing=True,
            learning_rate=1e-3,
            progress_bar=False,
        )
        trainer.fit(X="body", db=db, select=lt.Table("docs"))
        db.close()
    finally:
        fit_run._train_step = train_step  # type: ignore[method-assign]
        TrainBatches.steps = make_steps  # type: ignore[method-assign]
    wait, work = data[1:], train[1:]  # the first step: the loop's warm-up
    share = sum(wait) / (sum(wait) + sum(work))
    print(
        f"data wait: {share:.2%} of a step ({len(wait)} steps; median "
        f"{statistics.median(w / (w + t) for w, t in zip(wait, work)):.2%}; "
        f"{statistics.median(work) * 1e3:.0f} ms training, "
        f"{statistics.median(wait) * 1e3:.2f} ms waiting per step)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16, help="rows a step")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    texts = documents(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny")
        tokens_per_second(model, texts, args.max_length, args.rows)
        if args.steps:
            data_wait(model, texts, args.max_length, args.steps, Path(tmp))


if __name__ == "__main__":
    main()
