"""Supervised fine-tuning: responses to prompts, documents (no Y) and conversations, trained as
the summed next-token loss on their target tokens; one sequence a row, padded or packed, a step's
rows packed under a token budget into micro-batches alike in length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmtrain.formatting import Example, Formatter, PackedCollator, pack_examples, pad_collate
from llmtrain.objectives.base import Batching, Objective, counted
from llmtrain.objectives.loss import LossFunction


class SFT(Objective):
    name, roles, optional, trains = "sft", ("X", "Y"), ("Y",), "responses"

    def method(self) -> str:
        return ""

    def problems(self, config: Any) -> list[str]:
        best = config.training_args.best_key()
        if best is not None and best.startswith("eval_rewards/"):
            return [f"training_args.save_best_by={best!r}: rewards are a preference objective's"]
        return []

    def collate(self, how: Batching) -> Collate:
        return Collate(how.formatters, how.pad_id, how.source, how.packer, how.token_budget)

    def loss(self, run: Any) -> LossFunction:
        return LossFunction(run.base_model)


@dataclass
class Collate:
    """(key, row) pairs -> a padded or packed batch (``max_tokens``: a step's micro-batches)."""

    formatters: Sequence[Formatter]  # one a source: a mixture's by the part in each key
    pad_id: int
    source: str
    packer: PackedCollator | None
    max_tokens: int | None = None

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> Any:
        made = self._format(rows)
        examples = [e for e in made if e.input_ids]  # an empty one: a row the formatter skipped
        skipped = {"skipped": [e.key for e in made if not e.input_ids]}
        if self.max_tokens is None:
            if not examples:
                return skipped
            batch = self.packer(examples) if self.packer else pad_collate(examples, self.pad_id)
            return counted(batch, examples) | skipped
        assert self.packer is not None
        packed = micro_batches(examples, self.packer.max_length, self.max_tokens)
        return [
            counted(self.packer.collate_rows(rows), [e for row in rows for e in row])
            | (skipped if i == 0 else {})
            for i, rows in enumerate(packed)
        ] or [skipped]

    def _format(self, rows: list[tuple[Any, dict[str, Any]]]) -> list[Example]:
        if len(self.formatters) == 1:
            return self.formatters[0].format_batch(rows, source=self.source)
        parts: dict[int, list[tuple[Any, dict[str, Any]]]] = {}
        for key, row in rows:
            parts.setdefault(key["part"], []).append((key, row))
        return [
            example
            for part, mine in sorted(parts.items())
            for example in self.formatters[part].format_batch(mine, source=self.source)
        ]


#: a row shares a micro-batch only with rows at least this full relative to its fullest, so
#: at most 3% of the positions a micro-batch feeds the model are padding
FILL = 0.97


def micro_batches(
    examples: Sequence[Example], max_length: int, max_tokens: int
) -> list[list[list[Example]]]:
    """Rows of at most ``max_length`` tokens packed best-fit-decreasing, grouped fullest first into
    micro-batches of at most ``max_tokens // max_length`` rows alike in length (:data:`FILL`)."""
    rows = sorted(pack_examples(examples, max_length), key=lambda r: -sum(map(len, r)))
    per_batch = max(1, max_tokens // max_length)
    batches: list[list[list[Example]]] = []
    for row in rows:
        last = batches[-1] if batches else []
        if last and len(last) < per_batch and sum(map(len, row)) >= FILL * sum(map(len, last[0])):
            last.append(row)
        else:
            batches.append([row])
    return batches
