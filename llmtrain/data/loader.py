"""A DataLoader whose resume state counts rows delivered to the caller, not prefetched ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from llmtrain.data.position import Positioned
from llmtrain.db.keys import key_repr
from llmtrain.errors import ConfigError

if TYPE_CHECKING:
    from llmtrain.data.cached import CachedQueryDataset


@dataclass(frozen=True)
class LoaderBatch:
    """A batch's positions in the rank's epoch, collated rows (None: all skipped), and keys."""

    first: int
    last: int
    batch: Any
    deleted: list[Any]
    skipped: list[Any]
    changed: list[tuple[Any, Any]]  # (key, version read) of rows updated since the snapshot


_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "persistent_workers")


class _WorkerShare(IterableDataset[Positioned]):
    """What each worker runs: its share of one pass, with positions attached."""

    def __init__(self, dataset: CachedQueryDataset, epoch: int, start: int, chunk: int) -> None:
        self.dataset, self.epoch, self.start, self.chunk = dataset, epoch, start, chunk

    def __iter__(self) -> Iterator[Positioned]:
        return self.dataset.positioned(self.epoch, self.start, chunk=self.chunk)


class QueryDataLoader:
    """Batches of rows (dicts, or ``collate_fn(rows)``; ``with_keys``: ``(key, row)`` pairs), in
    the dataset's order for any ``num_workers`` (turns by batch); all-skipped ones not yielded."""

    def __init__(
        self,
        dataset: CachedQueryDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        with_keys: bool = False,
        **kwargs: Any,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        for banned in _OWNED:
            if banned in kwargs:
                raise ConfigError(
                    f"QueryDataLoader does not take {banned}=: the dataset owns "
                    "order and epochs (persistent workers would miss set_epoch)"
                )
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.collate_fn, self.with_keys, self.kwargs = collate_fn, with_keys, kwargs

    def _collate(self, items: list[Positioned]) -> LoaderBatch:
        """Skipped and deleted rows arrive as None; a worker's keys ride back with its batch."""
        skipped = [k for _, k, row in items if row is None]
        gone = [k for k in skipped if key_repr(k) in self.dataset.stats.deleted]
        rows: list[Any] = [(key, row) for _, key, row in items if row is not None]
        changed = [(key, row.pop("_version")) for key, row in rows if "_version" in row]
        if not self.with_keys:
            rows = [{**row, "_key": key} if self.dataset.return_keys else row for key, row in rows]
        batch = (self.collate_fn(rows) if self.collate_fn else rows) if rows else None
        positions = [pos for pos, _, _ in items]
        return LoaderBatch(min(positions), max(positions), batch, gone, skipped, changed)

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        yield from (made.batch for made in self.batches() if made.batch is not None)

    def batches(self) -> Iterator[LoaderBatch]:
        """Every batch of the pass, with its positions and skipped keys (all-skipped ones too)."""
        ds, position = self.dataset, self.dataset.position
        epoch, start = position.begin()
        length = len(ds)  # scans once here, so workers inherit it instead of each scanning
        # a private generator: starting an iterator must not draw from the global RNG, or a
        # resumed run (which starts one mid-training) would see different dropout masks
        kwargs = {"generator": torch.Generator().manual_seed(ds.seed + epoch), **self.kwargs}
        loader = DataLoader(
            _WorkerShare(ds, epoch, start, self.batch_size),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=self._collate,
            **kwargs,
        )
        for made in loader:
            position.consumed = made.last + 1
            ds.stats.deleted.update(map(key_repr, made.deleted))
            yield made
        position.finish(length)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.position.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any], **kwargs: Any) -> None:
        self.dataset.load_state_dict(state, **kwargs)
