"""Rows to the batches an objective trains: one sequence a row, padded or packed, a step's rows
packed under a token budget into micro-batches alike in length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmtrain.db.keys import key_repr
from llmtrain.formatting import Example, Formatter, PackedCollator, pack_examples, pad_collate


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


def counted(batch: dict[str, Any], examples: Sequence[Example]) -> dict[str, Any]:
    """The batch with its host-side counts as plain ints, made here: each ``int(tensor)`` in
    the loop released the GIL to the batch thread (measured: data wait 5-6% of a step -> 0.4%)."""
    batch["num_target_tokens"] = int(batch["num_target_tokens"])
    batch["num_tokens"] = sum(len(e) for e in examples)
    batch["keys"] = list(dict.fromkeys(key_repr(e.key) for e in examples))  # a row's windows
    return batch


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
