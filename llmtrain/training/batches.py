"""From the database to batches of token ids: the training view and collation.

The held-out split is part of the dataset's plan (``split="train"`` / ``"held_out"``): the
collate function tokenizes every row it gets, so every training batch has ``batch_size``
rows (an epoch's last may have fewer) and the step count comes from training rows only.

With packing, a step's rows are packed together under a token budget
(``max_tokens_per_batch``, default ``batch_size`` rows of ``max_length``): a step still
trains a fixed number of rows, ``batch_size x gradient_accumulation_steps`` per process,
read as one loader batch: they are packed best-fit-decreasing into rows of ``max_length``,
grouped into micro-batches of at most the budget with under 3% padding. The look-ahead is
the step's rows, so the steps per epoch (the LR schedule), the resume state (rows consumed,
at step boundaries) and the step count every rank agrees on stay what they are without a
budget; only the micro-batches per step vary, and processes agree on their number (the
shorter ones add an empty micro-batch: collectives stay paired).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmtrain.config.args import DataArguments
from llmtrain.data import CachedQueryDataset, QueryDataLoader, ReadStats, RunSnapshot
from llmtrain.data.snapshot import Split, key_repr
from llmtrain.db.queries import Query
from llmtrain.formatting import (
    IGNORE_INDEX,
    Example,
    Formatter,
    PackedCollator,
    pack_examples,
    pad_collate,
)

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database


@dataclass
class Collate:
    """(key, row) pairs -> tokenized, padded (or packed) batch; runs in DataLoader workers.
    With ``max_tokens`` the rows are one optimizer step's, and the result is the list of
    packed micro-batches of at most ``max_tokens`` tokens they fill."""

    formatter: Formatter
    pad_id: int
    source: str
    packer: PackedCollator | None
    max_tokens: int | None = None

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> Any:
        examples = self.formatter.format_batch(rows, source=self.source)
        if self.max_tokens is None:
            batch = self.packer(examples) if self.packer else pad_collate(examples, self.pad_id)
            return _counted(batch, examples)
        assert self.packer is not None
        return [
            _counted(self.packer.collate_rows(rows), [e for row in rows for e in row])
            for rows in micro_batches(examples, self.packer.max_length, self.max_tokens)
        ]


def _counted(batch: dict[str, Any], examples: Sequence[Example]) -> dict[str, Any]:
    """The batch with its host-side counts as plain ints, made where the batch is made: read
    in the loop instead, each ``int(tensor)`` is a torch call that lets go of the GIL, and the
    thread making the next batches held it on for 1.5 ms a step (measured: the data wait on
    the demo table fell from 5-6% of a step to 0.4%)."""
    batch["num_target_tokens"] = int(batch["num_target_tokens"])
    batch["num_tokens"] = sum(len(e) for e in examples)
    batch["keys"] = [key_repr(e.key) for e in examples]
    return batch


#: a row shares a micro-batch only with rows at least this full relative to its fullest, so
#: at most 3% of the positions a micro-batch feeds the model are padding
FILL = 0.97


def micro_batches(
    examples: Sequence[Example], max_length: int, max_tokens: int
) -> list[list[list[Example]]]:
    """Rows of at most ``max_length`` tokens, packed best-fit-decreasing, then grouped fullest
    first into micro-batches of at most ``max_tokens // max_length`` rows that are alike in
    length (:data:`FILL`): the step's last, partly filled rows go alone or together."""
    rows = sorted(pack_examples(examples, max_length), key=lambda r: -sum(map(len, r)))
    per_batch = max(1, max_tokens // max_length)
    batches: list[list[list[Example]]] = []
    for row in rows:
        batch = batches[-1] if batches else None
        if (
            batch
            and len(batch) < per_batch
            and sum(map(len, row)) >= FILL * sum(map(len, batch[0]))
        ):
            batch.append(row)
        else:
            batches.append([row])
    return batches


def make_collate(
    formatter: Formatter,
    tokenizer: Any,
    model: Any,
    args: DataArguments,
    source: str,
    *,
    token_budget: int | None = None,
) -> Collate:
    """The collate function of ``args``; ``token_budget``: the training one's, which packs a
    step's rows into micro-batches of that many tokens (evaluation keeps batches of rows)."""
    packer = None
    if args.packing:
        # flash kernels find packed examples from position ids only in a one-row batch
        impl = str(getattr(model.config, "_attn_implementation", None))
        packer = PackedCollator(args.max_length, tokenizer.pad_token_id, flat="flash" in impl)
    return Collate(formatter, tokenizer.pad_token_id, source, packer, token_budget)


def view_dataset(
    db: Database,
    select: Query,
    fields: list[str],
    args: DataArguments,
    *,
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
        shuffle=args.shuffle if shuffle is None else shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_remainder=args.drop_remainder if drop_remainder is None else drop_remainder,
        on_bad_row=args.on_bad_row,
        split=split,
        eval_fraction=args.eval_fraction if split != "all" else 0.0,
        snapshot=snapshot,
    )


@dataclass(frozen=True)
class _Taken:
    """Taken with each group as it is made: the dataset's epoch, resume point and counters,
    and how many first-skip epochs lineage had then."""

    epoch: int
    resume: tuple[int, int]
    stats: ReadStats
    skipped_in: int


class TrainBatches:
    """The one data object the training loop knows: each optimizer step's micro-batches
    across epochs, the steps per epoch, and the dataset position as resume state."""

    def __init__(
        self,
        dataset: CachedQueryDataset,
        args: DataArguments,
        *,
        batch_size: int,
        collate: Collate,
        accumulation: int = 1,
    ) -> None:
        self.dataset = dataset
        # with a token budget one loader batch is one step's rows (collate packs them)
        self.per_step = args.token_budget(batch_size) is not None
        self.accumulation = 1 if self.per_step else accumulation
        self.loader: QueryDataLoader = dataset.loader(
            batch_size * accumulation if self.per_step else batch_size,
            num_workers=args.num_workers,
            collate_fn=collate,
            with_keys=True,
        )
        # taken with the group the loop last took; None before any
        self._at: _Taken | None = None

    def __len__(self) -> int:
        """Optimizer steps per epoch on this rank (the same on every rank)."""
        return -(-len(self.loader) // self.accumulation)

    @property
    def epoch(self) -> int:
        return self.dataset.epoch if self._at is None else self._at.epoch

    @property
    def stats(self) -> ReadStats:
        """What this process read and skipped up to the group the loop last took: the rows
        first skipped in each epoch (lineage) exactly; the keys found deleted or bad as of
        the windows read, which may run ahead of the rows trained, as they always have."""
        if self._at is None:
            return self.dataset.stats
        live = self.dataset.stats
        skipped_in = list(live.skipped_in.items())  # one C call: the thread cannot cut in
        return dataclasses.replace(
            self._at.stats,
            skipped_once=set(live.skipped_once),
            deleted=set(live.deleted),
            skipped_in=dict(skipped_in[: self._at.skipped_in]),
        )

    def steps(self, start_epoch: int, num_epochs: int | None) -> Generator[list[Any]]:
        """Each optimizer step's micro-batches from ``start_epoch`` on (a group of batches may
        run into the next epoch, as without a budget it always has).

        A thread makes the next group while the loop trains on this one, so reading and
        formatting (the tokenizer releases the GIL) overlap the step instead of stalling it.
        Each group comes with the position, epoch and skip counts taken right after it was
        made; ``state_dict``, ``epoch`` and ``stats`` report those of the group the loop last
        took, so a group made ahead but not trained is never counted. Close the generator
        when done: that stops the thread."""
        made: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        stop = threading.Event()

        def hand_over(item: tuple[str, Any]) -> bool:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    made.put(item, timeout=0.05)
                    return True
            return False

        def produce() -> None:
            groups = self._groups(start_epoch, num_epochs)
            try:
                for group in groups:
                    if not hand_over(("group", (group, self._taken()))):
                        return
                hand_over(("done", self._taken()))
            except BaseException as exc:  # raised in the loop's thread, at the same step
                hand_over(("error", exc))
            finally:
                groups.close()

        thread = threading.Thread(target=produce, name="llmtrain-batches", daemon=True)
        thread.start()
        try:
            while True:
                kind, item = made.get()
                if kind == "error":
                    raise item
                if kind == "done":
                    self._at = item
                    return
                group, self._at = item
                yield group
        finally:
            stop.set()
            thread.join(timeout=30)  # a read stuck in the database must not hold up a failure

    def _groups(self, start_epoch: int, num_epochs: int | None) -> Generator[list[Any]]:
        batches = (batch for _, batch in self.epochs(start_epoch, num_epochs))
        if self.per_step:  # a loader batch is the step's packed micro-batches
            yield from batches
        else:
            while group := list(itertools.islice(batches, self.accumulation)):
                yield group

    def _taken(self) -> _Taken:
        """Where the data stands now, in work that does not grow with the keys found deleted
        or skipped (a live table may lose 100k rows: sorting and copying those every step
        took the making thread 50 ms); state and stats are built from it when asked."""
        stats = self.dataset.stats
        return _Taken(
            self.dataset.epoch,
            self.dataset.position.resume_point(),
            dataclasses.replace(
                stats,
                skipped_keys=list(stats.skipped_keys),  # at most 100
                skipped_once=set(),
                deleted=set(),
                skipped_in={},
            ),
            len(stats.skipped_in),  # insertion-ordered and only added to
        )

    def epochs(self, start_epoch: int, num_epochs: int | None) -> Iterator[tuple[int, Any]]:
        """(epoch, batch) from ``start_epoch`` on; endless when ``num_epochs`` is None."""
        epoch, idle_epochs = start_epoch, 0
        while num_epochs is None or epoch < num_epochs:
            self.loader.set_epoch(epoch)
            produced = False
            for batch in self.loader:
                produced = True
                yield epoch, batch
            # an epoch resumed at its end yields nothing; two in a row means no usable rows
            idle_epochs = 0 if produced else idle_epochs + 1
            if idle_epochs == 2:
                return
            epoch += 1

    def state_dict(self) -> dict[str, Any]:
        at = None if self._at is None else self._at.resume
        return self.dataset.state_dict(at)

    def load_state_dict(self, state: dict[str, Any], *, allow_changed_data: bool) -> None:
        self._at = None
        self.loader.load_state_dict(state, allow_changed_data=allow_changed_data)


def _empty_like(batch: dict[str, Any]) -> dict[str, Any]:
    """A one-token micro-batch with no target: it adds nothing to the loss or gradients, but
    runs the forward and backward (and their collectives) that the other processes run."""
    return {
        "input_ids": batch["input_ids"][:1, :1],
        "labels": torch.full((1, 1), IGNORE_INDEX),
        "position_ids": torch.zeros((1, 1), dtype=torch.long),
        "num_target_tokens": 0,
        "num_tokens": 0,
        "keys": [],
    }


def pad_group(group: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """``group`` with empty micro-batches added up to ``size`` (another rank's count)."""
    return group + [_empty_like(group[0])] * (size - len(group))


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }
