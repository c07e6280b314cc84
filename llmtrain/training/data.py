"""From the database to batches of token ids: the dataset, the held-out split and collation."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from llmtrain.datasets import CachedQueryDataset, QueryDataLoader
from llmtrain.datasets.cached import key_repr
from llmtrain.formatting import Formatter, PackedCollator, pad_collate
from llmtrain.formatting.collate import mask_dtype_for
from llmtrain.queries import Query
from llmtrain.training.args import DataArguments


def held_out(key: Any, fraction: float) -> bool:
    """Whether a row belongs to the eval split: a hash of its key, stable across runs."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(key_repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


Split = Literal["train", "held_out", "all"]


@dataclass
class Collate:
    """(key, row) pairs -> tokenized, padded (or packed) batch; runs in DataLoader workers.

    ``split`` keeps the rows outside the held-out fraction (training), inside it (its
    evaluation), or every row (an eval selection of its own).
    """

    formatter: Formatter
    pad_id: int
    source: str
    eval_fraction: float
    packer: PackedCollator | None
    split: Split = "train"

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any] | None:
        if self.split != "all":
            keep_held = self.split == "held_out"
            rows = [(k, r) for k, r in rows if held_out(k, self.eval_fraction) == keep_held]
        if not rows:
            return None
        examples = self.formatter.format_batch(rows, source=self.source)
        batch = self.packer(examples) if self.packer else pad_collate(examples, self.pad_id)
        batch["num_tokens"] = torch.tensor(sum(len(e) for e in examples))
        batch["keys"] = [key_repr(k) for k, _ in rows]
        return batch


def make_collate(formatter: Formatter, tokenizer: Any, model: Any, args: DataArguments,
                 source: str, *, split: Split = "train") -> Collate:
    packer = None
    if args.packing:
        packer = PackedCollator(args.max_length, tokenizer.pad_token_id,
                                mask_dtype=mask_dtype_for(model))
    return Collate(formatter, tokenizer.pad_token_id, source, args.eval_fraction, packer, split)


class TrainBatches:
    """Batches across epochs, with the dataset position as resume state."""

    def __init__(self, db: Any, select: Query, fields: list[str], args: DataArguments, *,
                 batch_size: int, seed: int, rank: int, world_size: int, collate: Collate
                 ) -> None:
        self.dataset = CachedQueryDataset(
            db, select, fields, cache_size=args.cache_size, shuffle=args.shuffle, seed=seed,
            rank=rank, world_size=world_size, drop_remainder=args.drop_remainder,
            on_bad_row=args.on_bad_row)
        self.loader: QueryDataLoader = self.dataset.loader(
            batch_size, num_workers=args.num_workers, collate_fn=collate, with_keys=True)
        self.batch_size = batch_size

    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def epochs(self, start_epoch: int, num_epochs: int | None) -> Iterator[tuple[int, Any]]:
        """(epoch, batch) from ``start_epoch`` on; endless when ``num_epochs`` is None."""
        epoch, idle_epochs = start_epoch, 0
        while num_epochs is None or epoch < num_epochs:
            self.loader.set_epoch(epoch)
            produced = False
            for batch in self.loader:
                if batch is not None:
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
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
