"""Database rows to token-id batches. Packing reads a step's rows as one loader batch, packed under
a token budget, so steps per epoch, the resume state and the ranks' step count ignore the budget."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmtrain.config.args import DataArguments
from llmtrain.data import CachedQueryDataset, QueryDataLoader, RunSnapshot
from llmtrain.data.plan import StepRule
from llmtrain.data.rows import Shape
from llmtrain.data.snapshot import Split
from llmtrain.db.keys import key_repr
from llmtrain.db.queries import Query
from llmtrain.formatting import (
    IGNORE_INDEX,
    Example,
    Formatter,
    PackedCollator,
    pack_examples,
    pad_collate,
)
from llmtrain.training.reference import pair_digest

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database


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
            return _counted(batch, examples) | skipped
        assert self.packer is not None
        packed = micro_batches(examples, self.packer.max_length, self.max_tokens)
        return [
            _counted(self.packer.collate_rows(rows), [e for row in rows for e in row])
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


@dataclass
class PairCollate:
    """Preference rows (the reader checked them) -> two sequences a row: the prompt with the answer
    (``chosen``, or KTO's completion), then with ``second`` (the rejected answer) or, with
    ``feedback`` (``second``: the label), the previous row's completion, KTO's mismatched pair for
    its KL estimate (TRL's). ``num_target_tokens`` counts rows, what a step is normalised by;
    ``per_batch``: each micro-batch's rows when the loader hands over a step's rows at once."""

    formatter: Formatter
    answer: str
    second: str
    pad_id: int
    source: str
    packer: PackedCollator | None
    per_batch: int | None = None
    feedback: bool = False

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> Any:
        size = self.per_batch or max(len(rows), 1)
        made = [self._pairs(rows[i : i + size]) for i in range(0, len(rows), size)]
        return made if self.per_batch is not None else made[0] if made else {}

    def _pairs(self, rows: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        f, n = self.formatter, len(rows)
        donors = rows[-1:] + rows[:-1] if self.feedback else rows  # feedback: the row before's
        field = self.answer if self.feedback else self.second
        others = [(k, {**r, self.answer: s[field]}) for (k, r), (_, s) in zip(rows, donors)]
        examples = f.format_batch(rows, source=self.source)
        examples += f.format_batch(others, source=self.source)
        if not f.train_on_inputs:  # both sequences after the same prompt ids: the shorter one
            for i in range(n):
                examples[i], examples[n + i] = same_prompt(examples[i], examples[n + i])
        if self.packer is None:
            batch = pad_collate(examples, self.pad_id)
        else:
            packed = pack_examples(examples, self.packer.max_length)
            batch = self.packer.collate_rows(packed, sequences=examples)
        pairs = zip(rows, examples[:n], examples[n:])
        digests = [pair_digest(key, a.input_ids, b.input_ids) for (key, _), a, b in pairs]
        liked = {"liked": [row[self.second] for _, row in rows]} if self.feedback else {}
        counts = {"num_target_tokens": n, "pairs": n, "pair_digests": digests}
        return _counted(batch, examples) | counts | liked


def same_prompt(a: Example, b: Example) -> tuple[Example, Example]:
    """A pair's sequences after one prompt: a long answer cuts its prompt from the left (BOS and
    the prompt's end kept), so the other takes that shorter prompt too, and the two log-probs
    compare answers to the same context."""
    na, nb = (
        next((i for i, t in enumerate(e.labels) if t != IGNORE_INDEX), len(e)) for e in (a, b)
    )
    if a.input_ids[:na] == b.input_ids[:nb]:
        return a, b
    short, n = (a.input_ids[:na], na) if na < nb else (b.input_ids[:nb], nb)
    long = b.input_ids[:nb] if na < nb else a.input_ids[:na]
    head = next((i for i, (s, t) in enumerate(zip(short, long)) if s != t), n)  # BOS
    if head == n or short[head:] != long[len(long) - (n - head) :]:
        return a, b  # not one prompt cut from the left: left as they are

    def cut(e: Example, m: int) -> Example:
        ids = short + e.input_ids[m:]
        return Example(ids, [IGNORE_INDEX] * n + e.labels[m:], e.key, truncated=True)

    return (a, cut(b, nb)) if na < nb else (cut(a, na), b)


def _counted(batch: dict[str, Any], examples: Sequence[Example]) -> dict[str, Any]:
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


def make_collate(
    formatter: Formatter | Sequence[Formatter],
    tokenizer: Any,
    model: Any,
    args: DataArguments,
    source: str,
    *,
    token_budget: int | None = None,
    shape: Shape = "text",
    fields: Sequence[str] = (),
    batch_size: int = 1,
) -> Collate | PairCollate:
    """The collate of ``args``: ``token_budget`` packs a step's rows, ``shape`` selects pairs."""
    packer = None
    if args.packing:
        # flash kernels find packed examples from position ids only in a one-row batch
        impl = str(getattr(model.config, "_attn_implementation", None))
        packer = PackedCollator(args.max_length, tokenizer.pad_token_id, flat="flash" in impl)
    formatters = [formatter] if isinstance(formatter, Formatter) else list(formatter)
    if shape in ("pairs", "feedback"):
        per_batch = batch_size if token_budget is not None else None
        answer, second = fields[1:]
        pad, feedback = tokenizer.pad_token_id, shape == "feedback"
        return PairCollate(formatters[0], answer, second, pad, source, packer, per_batch, feedback)
    return Collate(formatters, tokenizer.pad_token_id, source, packer, token_budget)


def view_dataset(
    db: Database,
    select: Query,
    fields: list[str],
    args: DataArguments,
    *,
    shape: Shape = "text",
    split: Split,
    snapshot: RunSnapshot | None,
    rank: int,
    world_size: int,
    seed: int = 0,
    shuffle: bool | None = None,
    drop_remainder: bool | None = None,
) -> CachedQueryDataset:
    """The dataset of one view of ``select`` (training rows, held-out rows or all of them)."""
    return CachedQueryDataset(
        db,
        select,
        fields,
        cache_size=args.cache_size,
        shuffle_block=args.shuffle_block,
        shuffle=args.shuffle if shuffle is None else shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_remainder=args.drop_remainder if drop_remainder is None else drop_remainder,
        on_bad_row=args.on_bad_row,
        split=split,
        eval_fraction=args.eval_fraction if split != "all" else 0.0,
        snapshot=snapshot,
        version_column=args.version_column,
        conversations=args.chat_template,  # a source of one field: conversations
        shape=shape,
    )


@dataclass(frozen=True)
class StepGroup:
    """One step's micro-batches on this rank, and the keys reading skipped, deleted or changed."""

    step: int
    epoch: int
    batches: list[dict[str, Any]]
    skipped: list[Any]  # keys
    deleted: list[Any]
    changed: list[tuple[Any, Any]]  # (key, version read): rows updated since the snapshot

    @property
    def keys(self) -> list[str]:
        """The step's rows (a document cut into windows counts once)."""
        return list(dict.fromkeys(k for b in self.batches for k in b["keys"]))


class TrainBatches:
    """Each optimizer step's micro-batches, by :class:`~llmtrain.data.plan.StepRule`."""

    def __init__(
        self,
        dataset: CachedQueryDataset,
        args: DataArguments,
        *,
        batch_size: int,
        collate: Collate | PairCollate,
        accumulation: int = 1,
    ) -> None:
        self.dataset = dataset
        # with a token budget one loader batch is one step's rows (collate packs them)
        self.packed = args.token_budget(batch_size) is not None
        rows = batch_size * accumulation
        self.rule = StepRule(dataset.order, rows, rows if self.packed else batch_size)
        self.loader: QueryDataLoader = dataset.loader(
            self.rule.micro,
            num_workers=args.dataloader_num_workers,
            collate_fn=collate,
            with_keys=True,
        )

    def __len__(self) -> int:
        """Optimizer steps per epoch on this rank (the same on every rank)."""
        return self.rule.per_epoch

    def steps(self, after: int, total: int) -> Generator[StepGroup]:
        """Groups of steps ``after`` + 1 to ``total``, read a step ahead by a thread (close it)."""
        made: queue.Queue[Any] = queue.Queue(maxsize=1)  # a group, an error, or None: done
        stop = threading.Event()

        def hand_over(item: Any) -> bool:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    made.put(item, timeout=0.05)
                    return True
            return False

        def produce() -> None:
            with contextlib.closing(self._groups(after, total)) as groups:
                try:
                    for group in groups:
                        if not hand_over(group):  # the consumer stopped
                            return
                    hand_over(None)
                except BaseException as exc:  # raised in the loop's thread, at the same step
                    hand_over(exc)

        thread = threading.Thread(target=produce, name="llmtrain-batches", daemon=True)
        thread.start()
        try:
            while (item := made.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=30)  # a read stuck in the database must not hold up a failure

    def _groups(self, after: int, total: int) -> Generator[StepGroup]:
        """Each group as soon as its last position is read."""
        rule, per_rank = self.rule, self.rule.order.per_rank
        step, (epoch, start) = after, rule.after(after)
        while step < total and per_rank:
            self.dataset.position.restore(epoch, start)
            group: StepGroup | None = None
            for made in self.loader.batches():
                if group is None:
                    number = int(rule.steps(epoch, np.int64(made.first)))
                    group = StepGroup(number, epoch, [], [], [], [])
                if made.batch is not None:
                    batches = made.batch if self.packed else [made.batch]
                    group.skipped.extend(_formatter_skips(batches))
                    group.batches.extend(b for b in batches if b != {})  # {}: all skipped
                group.skipped.extend(made.skipped)
                group.deleted.extend(made.deleted)
                group.changed.extend(made.changed)
                end = min((group.step - epoch * rule.per_epoch) * rule.rows, per_rank)
                if made.last + 1 >= end:
                    yield group
                    step, group = group.step, None
                    if step >= total:
                        return
            epoch, start = epoch + 1, 0


def _formatter_skips(batches: list[Any]) -> list[Any]:
    """The keys of the rows the formatter skipped (:class:`Collate`), taken off the batches."""
    return [k for b in batches if isinstance(b, dict) for k in b.pop("skipped", [])]


def empty_batch(pad_id: int) -> dict[str, Any]:
    """A one-token micro-batch, no target: it runs the collectives other ranks run, adds nothing."""
    return {
        "input_ids": torch.full((1, 1), pad_id),
        "labels": torch.full((1, 1), IGNORE_INDEX),
        "position_ids": torch.zeros((1, 1), dtype=torch.long),
        "num_target_tokens": 0,
        "num_tokens": 0,
        "keys": [],
    }


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }
