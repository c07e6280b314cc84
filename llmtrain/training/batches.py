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
from llmtrain.data.rows import RowCheck
from llmtrain.data.snapshot import Split
from llmtrain.db.queries import Query
from llmtrain.formatting import IGNORE_INDEX, Formatter, PackedCollator
from llmtrain.objectives import OBJECTIVES, Objective
from llmtrain.objectives.base import Batching

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database


def make_collate(
    formatter: Formatter | Sequence[Formatter],
    tokenizer: Any,
    model: Any,
    args: DataArguments,
    source: str,
    *,
    objective: Objective = OBJECTIVES["sft"],
    fields: Sequence[str] = (),
    token_budget: int | None = None,
    batch_size: int = 1,
    settings: Any = None,
) -> Any:
    """The objective's collate under ``args`` (``token_budget``: a step's rows packed;
    ``settings``: objective_args)."""
    packer = None
    if args.packing:
        # flash kernels find packed examples from position ids only in a one-row batch
        impl = str(getattr(model.config, "_attn_implementation", None))
        packer = PackedCollator(args.max_length, tokenizer.pad_token_id, flat="flash" in impl)
    formatters = [formatter] if isinstance(formatter, Formatter) else list(formatter)
    pad = tokenizer.pad_token_id
    how = Batching(formatters, pad, source, packer, fields, token_budget, batch_size, settings)
    return objective.collate(how)


def view_dataset(
    db: Database,
    select: Query,
    fields: list[str],
    args: DataArguments,
    *,
    check: RowCheck | None = None,
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
        check=check,
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
        collate: Any,
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
