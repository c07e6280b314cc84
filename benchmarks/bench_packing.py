"""Real (non-padding) tokens among all positions fed to the model, side by side:

    python benchmarks/bench_packing.py [--rows 3000] [--accumulation 1]

The rows of ``bench_trainer.py`` (log-normal prompt and answer lengths), formatted by the
tokenizer of ``llmtrain.testing.tiny_model`` at each ``max_length``, one epoch in order, for
each batch size B:

* **padded**: B rows per micro-batch, right-padded to the longest (``pad_collate``);
* **rows, first-fit**: B rows per micro-batch packed first-fit in arrival order (packing
  before token budgets);
* **rows, BFD**: the same B rows packed best-fit-decreasing (``PackedCollator`` now);
* **budget**: ``max_tokens_per_batch = B x max_length`` (the memory of B padded rows of
  max_length): each step's ``B x accumulation`` rows packed into as few micro-batches of at
  most the budget as they need (``llmtrain.training.batches.micro_batches``, what the training
  collate runs). Goal: >= 0.97 at every B.

The fraction is tokens / sum over micro-batches of rows x width (the longest row): what the
model is given, padding included.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_trainer import TEMPLATE, make_rows  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from llmtrain.formatting import Example, Formatter, pack_examples  # noqa: E402
from llmtrain.testing import tiny_model  # noqa: E402
from llmtrain.training.batches import micro_batches  # noqa: E402

GOAL = 0.97
Layout = list[list[list[Example]]]  # micro-batches of rows of examples


def first_fit(examples: Sequence[Example], max_length: int) -> list[list[Example]]:
    """Packing before token budgets: each example into the first row with room, in order."""
    rows: list[list[Example]] = []
    for e in examples:
        for row in rows:
            if sum(map(len, row)) + len(e) <= max_length:
                row.append(e)
                break
        else:
            rows.append([e])
    return rows


def fraction(layout: Layout) -> float:
    tokens = sum(len(e) for batch in layout for row in batch for e in row)
    cells = sum(len(batch) * max(sum(map(len, row)) for row in batch) for batch in layout)
    return tokens / cells


def chunks(examples: Sequence[Example], size: int) -> list[Sequence[Example]]:
    return [examples[i : i + size] for i in range(0, len(examples), size)]


def layouts(
    examples: Sequence[Example], max_length: int, size: int, accumulation: int
) -> dict[str, Callable[[], Layout]]:
    return {
        "padded": lambda: [[[e] for e in c] for c in chunks(examples, size)],
        "rows, first-fit": lambda: [first_fit(c, max_length) for c in chunks(examples, size)],
        "rows, BFD": lambda: [pack_examples(c, max_length) for c in chunks(examples, size)],
        "budget": lambda: [
            batch
            for step in chunks(examples, size * accumulation)
            for batch in micro_batches(step, max_length, size * max_length)
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches' rows per step")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(Path("/tmp/llmtrain-bench-tiny")))
    rows = [(k, {"instruction": x, "output": y}) for k, x, y in make_rows(args.rows)]
    sizes = [1, 2, 4, 8, 16, 32, 64]
    names = list(layouts([], 1, 1, 1))
    ok = True
    for max_length in (256, 512, 1024):
        fmt = Formatter(
            tokenizer, TEMPLATE, max_length=max_length, x_field="instruction", y_field="output"
        )
        examples = fmt.format_batch(rows)
        print(f"\nmax_length={max_length}, accumulation={args.accumulation}: real-token fraction")
        print(f"{'':18s}" + "".join(f"{f'B={s}':>8s}" for s in sizes))
        for name in names:
            built = [layouts(examples, max_length, s, args.accumulation)[name]() for s in sizes]
            cells = [fraction(layout) for layout in built]
            if name == "budget":
                ok &= min(cells) >= GOAL
            print(f"{name:18s}" + "".join(f"{c:8.3f}" for c in cells))
        steps = [-(-len(examples) // (s * args.accumulation)) for s in sizes]
        print(
            f"{'budget: mb/step':18s}"
            + "".join(f"{len(layout) / n:8.2f}" for layout, n in zip(built, steps))
            + "  (micro-batches a step; padded: accumulation)"
        )
    print(f"\nbudget >= {GOAL} at every B and max_length: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
