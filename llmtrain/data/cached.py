"""CachedQueryDataset: a selection streamed in windows (at most three in memory), sharded by
rank and worker. Each window's keys come from the pinned snapshot and its rows by key in one
statement: rows inserted meanwhile are not read, rows deleted meanwhile are skipped."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, get_args

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from llmtrain.data.loader import QueryDataLoader
from llmtrain.data.plan import MixOrder, Order
from llmtrain.data.position import Position, Positioned
from llmtrain.data.rows import RowCheck, Shape, check_on_bad_row, check_row, normalise_fields
from llmtrain.data.snapshot import (
    Blobs,
    MemoryStore,
    MixedView,
    RunSnapshot,
    Split,
    View,
    take_snapshot,
    version_column_of,
)
from llmtrain.db.backend import Key, Row
from llmtrain.db.keys import key_repr
from llmtrain.db.queries import MESSAGES, Conversations, Mix, Part, Query
from llmtrain.errors import BadRowError, ConfigError, DataChangedError
from llmtrain.placement import Placement

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database

log = logging.getLogger("llmtrain.data")
STATE_FORMAT = 4
# what the epoch's order depends on: a state resumes only a dataset with the same values
_ORDER = (
    "seed",
    "world_size",
    "shuffle_block",
    "shuffle",
    "drop_remainder",
    "split",
    "eval_fraction",
)
Window = list[Positioned]  # a skipped bad row comes as None, a refused one as its BadRowError
WindowKeys = tuple[np.ndarray, list[Key], list[Any] | None]  # positions, keys, versions


@dataclass
class ReadStats:
    """What this process read from the database (rows, keys, statements) and skipped."""

    rows_fetched: int = 0
    keys_fetched: int = 0
    statements: int = 0
    skipped: int = 0
    skipped_keys: list[Any] = field(default_factory=list)
    skipped_once: set[str] = field(default_factory=set)  # key_reprs, logged once, not per epoch
    deleted: set[str] = field(default_factory=set)  # key_reprs of snapshot rows found gone


class CachedQueryDataset(IterableDataset[Row]):
    """Iterable rows of ``select`` in a seeded order, each rank reading only its share.

    ``cache_size`` rows make a window (one statement), ``shuffle_block`` keys a block of the
    order (:class:`~llmtrain.data.plan.Order`): the read size never changes the order. ``split``
    with ``eval_fraction`` reads the training or held-out view. ``snapshot``: the run's, chunks in
    ``store`` (default ``db.artifacts``), else one taken into memory. With ``version_column``, a
    row changed since the snapshot carries the version read in ``"_version"``."""

    def __init__(
        self,
        db: Database,
        select: Query,
        fields: str | Sequence[str],
        *,
        cache_size: int = 1024,
        shuffle_block: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_remainder: bool = True,
        on_bad_row: str = "raise",
        return_keys: bool = False,
        prefetch: bool | None = None,
        split: Split = "all",
        eval_fraction: float = 0.0,
        snapshot: RunSnapshot | None = None,
        store: Blobs | None = None,
        version_column: str | None = None,
        conversations: bool = False,
        check: RowCheck | None = None,
    ) -> None:
        if not isinstance(select, Query):
            raise ConfigError(f"select must be a llmtrain query, got {type(select).__name__}")
        for name, value in (("cache_size", cache_size), ("shuffle_block", shuffle_block)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if split not in get_args(Split):
            raise ConfigError(f"split must be one of {get_args(Split)}, got {split!r}")
        if not 0 <= eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        if snapshot is not None and not snapshot.fits(select, eval_fraction * (split != "all")):
            raise ConfigError(
                f"snapshot= describes another query or eval_fraction than {select.source} "
                f"with eval_fraction={eval_fraction}"
            )
        self.db, self.query, self.fields = db, select, normalise_fields(fields)
        mixed = isinstance(select, Mix)
        parts = select.parts if isinstance(select, Mix) else (Part(select),)
        self.sources = [
            _Source.of(p, i if mixed else None, self.fields, conversations, version_column)
            for i, p in enumerate(parts)
        ]
        self.check = check
        # versions are compared only against a snapshot given (a run's), not one taken here
        self.versioned = snapshot is not None and any(s.version_column for s in self.sources)
        self.cache_size, self.shuffle_block = cache_size, shuffle_block
        self.shuffle, self.seed = shuffle, int(seed)
        self.drop_remainder, self.return_keys, self.prefetch = drop_remainder, return_keys, prefetch
        self.on_bad_row = check_on_bad_row(on_bad_row)
        self.split, self.eval_fraction = split, float(eval_fraction)
        self._rank, self._world, self._snapshot = rank, world_size, snapshot
        default = db.artifacts if snapshot is not None else MemoryStore()
        self.store: Blobs = store if store is not None else default
        self.position = Position()
        self.stats = ReadStats()

    @cached_property
    def placement(self) -> Placement:
        return Placement.resolve(self._rank, self._world)

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def snapshot(self) -> RunSnapshot:
        """The selection's snapshot: the one given, else taken (into memory) on first use."""
        if self._snapshot is None:
            fraction = self.eval_fraction * (self.split != "all")
            self.store = store = MemoryStore()
            self._snapshot = take_snapshot(self.db, self.query, eval_fraction=fraction, store=store)
            self.stats.statements += self._snapshot.statements
            self.stats.keys_fetched += self._snapshot.count
        return self._snapshot

    @property
    def view(self) -> View:
        """The keys of the rows this dataset reads, in key order."""
        return self.snapshot().view(self.split)

    @property
    def data_fingerprint(self) -> str:
        return self.snapshot().fingerprint

    @property
    def order(self) -> Order:
        return epoch_order(self.view, self.query, self, self.seed, self.world_size)

    def __len__(self) -> int:
        return self.order.per_rank

    def set_epoch(self, epoch: int) -> None:
        self.position.set_epoch(epoch)

    def state_dict(self, at: tuple[int, int] | None = None) -> dict[str, Any]:
        """The state to resume from: now, or at ``at`` (from :meth:`Position.resume_point`)."""
        epoch, consumed = self.position.resume_point() if at is None else at
        return {
            "format": STATE_FORMAT,
            "query": self.query.fingerprint(),
            "data": self.data_fingerprint,
            "count": self.snapshot().count,
            "epoch": epoch,
            "consumed": consumed,
            **{name: getattr(self, name) for name in _ORDER},
            "deleted": sorted(self.stats.deleted),
        }

    def load_state_dict(self, state: dict[str, Any], *, allow_changed_data: bool = False) -> None:
        """Continue where ``state`` was taken; refuse changed rows unless ``allow_changed_data``."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError(
                f"not a CachedQueryDataset state (format {STATE_FORMAT}): {str(state)[:200]}"
            )
        if state["query"] != self.query.fingerprint():
            raise DataChangedError(
                "the state was taken for a different query "
                f"({state['query']} != {self.query.fingerprint()})"
            )
        for name in _ORDER:
            mine = getattr(self, name)
            if state[name] != mine:
                raise ConfigError(
                    f"cannot resume: the state has {name}={state[name]!r} but "
                    f"this dataset has {name}={mine!r}; the order would differ"
                )
        snapshot = self.snapshot()
        if state["data"] != snapshot.fingerprint:
            what = (
                f"row count {state['count']} -> {snapshot.count}"
                if state["count"] != snapshot.count
                else "rows were added, removed or re-keyed (same count)"
            )
            message = f"the rows of {self.query.source} changed since the state was taken: {what}"
            if not allow_changed_data:
                raise DataChangedError(message + "; pass allow_changed_data=True to go on")
            log.warning("%s; continuing as asked", message)
        self.stats.deleted |= set(state.get("deleted", ()))
        self.position.restore(state["epoch"], min(state["consumed"], len(self)))

    def __iter__(self) -> Iterator[Row]:
        epoch, start = self.position.begin()
        # closing: stops the prefetch thread now, even on an error or a break
        with closing(self.positioned(epoch, start, chunk=1)) as rows:
            for pos, key, row in rows:
                self.position.consumed = pos + 1
                if row is not None:
                    yield {**row, "_key": key} if self.return_keys else row
            self.position.finish(len(self))

    def loader(self, batch_size: int, **kwargs: Any) -> QueryDataLoader:
        """A :class:`QueryDataLoader`: its ``state_dict()`` counts only delivered rows."""
        return QueryDataLoader(self, batch_size, **kwargs)

    def positioned(
        self, epoch: int, start: int, *, chunk: int
    ) -> Generator[Positioned, None, None]:
        """This worker's rows of ``epoch`` from ``start`` (skipped: None): worker ``k`` of ``n``
        takes chunks ``k, k + n, ...`` of ``chunk`` positions, so any ``n`` yields the same."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        windows = self._windows(epoch, start, chunk, worker, workers)
        # prefetch=None: fetch ahead from a server (the thread waits without the GIL), not from
        # SQLite, whose fetch is CPU work contending with the consumer (measured: 15-25% slower)
        prefetch = (
            self.prefetch if self.prefetch is not None else not self.db.uri.startswith("sqlite")
        )
        fetched = self._prefetched(windows) if prefetch else (self._fetch(w) for w in windows)
        with closing(fetched):  # stops the prefetch thread now, even on an error or a break
            for window in fetched:
                for item in window:
                    if isinstance(item[2], BadRowError):  # raised where the row is reached
                        raise item[2]
                    yield item

    def _windows(
        self, epoch: int, start: int, chunk: int, worker: int, workers: int
    ) -> Iterator[WindowKeys]:
        """This worker's rows, ``cache_size`` a window, their keys read from the snapshot."""
        view = self.view
        for offset, indexes in self.order.spans(epoch, self.placement.rank, start):
            positions = offset + np.arange(len(indexes))
            mine = positions >= start
            if workers > 1:
                mine &= (positions - start) // chunk % workers == worker
            picks = np.flatnonzero(mine)
            for i in range(0, len(picks), self.cache_size):
                window = picks[i : i + self.cache_size]
                at = indexes[window]
                versions = view.versions_at(self.store, at) if self.versioned else None
                yield positions[window], view.keys_at(self.store, at), versions

    def _prefetched(self, windows: Iterator[WindowKeys]) -> Generator[Window, None, None]:
        """Fetch window i+1 on a thread while window i is consumed; then None, or the error."""
        ready: queue.Queue[Window | BaseException | None] = queue.Queue(maxsize=1)
        stop = threading.Event()

        def produce() -> None:
            try:
                for window in windows:
                    ready.put(self._fetch(window))  # the consumer drains the queue once it stops
                    if stop.is_set():
                        return
                ready.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                ready.put(exc)

        thread = threading.Thread(target=produce, name="llmtrain-prefetch", daemon=True)
        thread.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    ready.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)

    def _fetch(self, window: WindowKeys) -> Window:
        """One window's rows by key, a statement a source (None: deleted since the snapshot)."""
        positions, wanted, versions = window
        reprs = [key_repr(k) for k in wanted]
        found: dict[str, tuple[_Source, Row]] = {}
        for source in self.sources:
            if source.part is None:  # one source: every key, as read (the hot path)
                picks, keys, mine = list(range(len(wanted))), wanted, versions
            else:
                picks = [i for i, k in enumerate(wanted) if k["part"] == source.part]
                keys = [wanted[i]["key"] for i in picks]
                mine = versions and [versions[i] for i in picks]
            if picks:
                read = source.read(self.db, keys, mine)
                found |= {reprs[i]: (source, row) for i, row in zip(picks, read) if row is not None}
                self.stats.statements += 1
        self.stats.rows_fetched += len(found)
        missing = [r for r in reprs if r not in found]
        if missing:
            self.stats.deleted.update(missing)
            log.warning(
                "%s: %d row(s) of this window were deleted or forgotten since the run's "
                "snapshot; skipped (%d so far)",
                self.query.source,
                len(missing),
                len(self.stats.deleted),
            )
        return [
            (p, k, self._checked(k, *found[r]) if r in found else None)
            for p, k, r in zip(positions.tolist(), wanted, reprs)
        ]

    def _checked(self, key: Key, source: _Source, row: Row) -> Any:
        """The row, None (skipped) or the BadRowError to raise when the row is reached."""
        try:
            if check_row(
                source.query.source,
                source.own(key),
                row,
                source.fields,
                self.on_bad_row,
                logged=self.stats.skipped_once,
                shape=source.shape,
                check=self.check,
            ):
                return row
        except BadRowError as exc:
            return exc
        self.stats.skipped += 1
        if len(self.stats.skipped_keys) < 100:
            self.stats.skipped_keys.append(key)
        return None


@dataclass(frozen=True)
class _Source:
    """One query a dataset reads (a mixture's each source), with the fields it trains."""

    query: Query
    fields: tuple[str, ...]
    shape: Shape  # what its fields hold ("conversation": its one field is a list of messages)
    version_column: str | None  # read to compare with the snapshot's (None: not compared)
    part: int | None  # a mixture's source index: its keys come tagged with it

    @classmethod
    def of(
        cls,
        part: Part,
        index: int | None,
        fields: tuple[str, ...],
        chat: bool,
        version_column: str | None,
    ) -> _Source:
        own = normalise_fields(part.fields_or(fields))
        chat = isinstance(part.select, Conversations) or (chat and len(own) == 1)
        shape: Shape = "conversation" if chat else "text"
        return cls(part.select, own, shape, version_column_of(part.select, version_column), index)

    def own(self, key: Key) -> Key:
        return key if self.part is None else key["key"]

    def read(self, db: Database, keys: list[Key], versions: list[Any] | None) -> list[Row | None]:
        """The rows of ``keys`` (None: deleted); one changed since carries it in ``"_version"``."""
        column = self.version_column if versions is not None else None
        read_too = bool(column) and column not in self.fields  # fetched only to compare
        fields = (*self.fields, column) if column and read_too else self.fields
        # matched by key_repr: MongoDB keeps 1 and True apart, and a document _id is no dict key
        found = {key_repr(k): row for k, row in db.backend.fetch_by_keys(self.query, fields, keys)}
        rows = [found.get(key_repr(k)) for k in keys]
        if column and versions is not None:  # (both, for mypy)
            for row, version in zip(rows, versions):
                if row is None:
                    continue
                read = row.pop(column, None) if read_too else row.get(column)
                if isinstance(self.query, Conversations):
                    read = _as_snapshotted(row, read, version)
                if read != version:
                    row["_version"] = read
        return rows


def epoch_order(view: View, query: Query, args: Any, seed: int, world: int) -> Order:
    """The epoch order of ``view`` by ``args``' options: what datasets read, lineage derives."""
    options = (args.shuffle_block, seed, args.shuffle, args.drop_remainder, world)
    if not isinstance(view, MixedView):
        return Order(view.count, *options)
    assert isinstance(query, Mix)
    counts = tuple(p.count for p in view.parts)
    rows = (query.epoch_rows or sum(counts)) if sum(counts) else 0
    return MixOrder(rows, *options, counts, query.weights or tuple(map(float, counts)))


def _as_snapshotted(row: Row, turns: Any, last: Any) -> Any:
    """Drops turns after ``last`` (a later run's) as the snapshot did; returns the last kept."""
    kept = [i for i, turn in enumerate(turns) if turn <= last]
    row[MESSAGES] = [row[MESSAGES][i] for i in kept]
    return turns[kept[-1]] if kept else None
