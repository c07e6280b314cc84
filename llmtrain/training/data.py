"""From the database to batches of token ids: the training view and collation.

The held-out split is part of the dataset's plan (``split="train"`` / ``"held_out"``): the
collate function tokenizes every row it gets, so every training batch has ``batch_size``
rows (an epoch's last may have fewer) and the step count comes from training rows only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmtrain.datasets import CachedQueryDataset, QueryDataLoader, ReadStats, RunSnapshot
from llmtrain.datasets.snapshot import Split, held_out, key_repr
from llmtrain.formatting import Formatter, PackedCollator, pad_collate
from llmtrain.formatting.collate import mask_dtype_for
from llmtrain.queries import Query
from llmtrain.training.args import DataArguments

__all__ = ["Collate", "TrainBatches", "held_out", "make_collate", "to_device", "view_dataset"]


@dataclass
class Collate:
    """(key, row) pairs -> tokenized, padded (or packed) batch; runs in DataLoader workers."""

    formatter: Formatter
    pad_id: int
    source: str
    packer: PackedCollator | None

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        examples = self.formatter.format_batch(rows, source=self.source)
        batch: dict[str, Any] = (
            self.packer(examples) if self.packer else pad_collate(examples, self.pad_id)
        )
        batch["num_tokens"] = torch.tensor(sum(len(e) for e in examples))
        batch["keys"] = [key_repr(k) for k, _ in rows]
        return batch


def make_collate(
    formatter: Formatter, tokenizer: Any, model: Any, args: DataArguments, source: str
) -> Collate:
    packer = None
    if args.packing:
        packer = PackedCollator(
            args.max_length, tokenizer.pad_token_id, mask_dtype=mask_dtype_for(model)
        )
    return Collate(formatter, tokenizer.pad_token_id, source, packer)


def view_dataset(
    db: Any,
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


class TrainBatches:
    """The one data object the training loop knows: batches across epochs, the batch count
    per epoch, and the dataset position as resume state."""

    def __init__(
        self, dataset: CachedQueryDataset, args: DataArguments, *, batch_size: int, collate: Collate
    ) -> None:
        self.dataset = dataset
        self.loader: QueryDataLoader = dataset.loader(
            batch_size, num_workers=args.num_workers, collate_fn=collate, with_keys=True
        )
        self.batch_size = batch_size

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.loader)

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    @property
    def stats(self) -> ReadStats:
        """What this process read and skipped (the loop reports it; it never reaches past)."""
        return self.dataset.stats

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
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, allow_changed_data: bool) -> None:
        self.loader.load_state_dict(state, allow_changed_data=allow_changed_data)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }
