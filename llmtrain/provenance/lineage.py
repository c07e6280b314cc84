"""Row lineage, derived not logged: which rows trained which run, checkpoint and model.

A run's order is a pure function of its record: the keys it pinned (its snapshot), the seed
and the plan parameters (``datasets/plan.py``), the world size, the batch size and gradient
accumulation, and the step it reached. Replaying that function gives every (key, epoch,
step, rank) the loop trained on without the loop ever logging a key; the rows it skipped
(bad rows, rows deleted during the run) are the only per-key facts a run records.

Memory stays a few windows of keys whatever the run's size: the walk reads the key list a
block at a time, in the epoch's block order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from llmtrain.data.plan import rank_pieces, rows_per_rank
from llmtrain.data.snapshot import key_repr
from llmtrain.db.backend import Key
from llmtrain.errors import StoreError

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database

#: record field: {key_repr: first epoch it was skipped in} (bad rows, rows deleted mid-run)
SKIPPED = "skipped_keys"
#: record field: the run this one continued from (an incremental fit): {run_id, steps, model}
PARENT = "parent"
FORGOTTEN = "forgotten"  # the metadata record type of a source's forgotten keys


class SnapshotKeys:
    """A run's training keys, read from its stored snapshot a chunk at a time."""

    def __init__(self, view: Any, store: Any) -> None:
        self.view, self.store = view, store

    @property
    def count(self) -> int:
        return int(self.view.count)

    def slice(self, start: int, stop: int) -> Sequence[Key]:
        return self.view.keys(self.store, start, stop)

    def chunks(self) -> Iterator[Sequence[Key]]:
        size = self.view.chunk_size
        return (self.view.keys(self.store, i, i + size) for i in range(0, self.count, size))

    def versions(self) -> Iterator[Sequence[Any]] | None:
        """The versions of the keys, chunk by chunk alongside :meth:`chunks`; None without."""
        if self.view.versions is None:
            return None
        size = self.view.chunk_size
        return (self.view.versions_of(self.store, i, i + size) for i in range(0, self.count, size))


class Consumed(NamedTuple):
    """One row trained at one optimizer step of one run."""

    key: Key
    epoch: int
    step: int
    rank: int
    run_id: str


@dataclass(frozen=True)
class Plan:
    """What decided a run's order and steps; every field comes from the run's record."""

    run_id: str
    count: int  # rows in the run's training view
    block_size: int
    seed: int
    shuffle: bool
    drop_remainder: bool
    world_size: int
    batch_size: int
    accum: int
    epochs: int | None  # None: max_steps bounds the run, the stream of epochs is endless
    steps: int  # the last step the run trained

    @classmethod
    def of_run(cls, run: Any, count: int, steps: int | None = None) -> Plan:
        info = run.info
        config = info.get("config") or {}
        t, d = config.get("training_args") or {}, config.get("data_args") or {}
        reached = info.get("steps")
        return cls(
            run_id=run.run_id,
            count=count,
            block_size=int(d.get("cache_size", 1024)),
            seed=int(t.get("seed", 0)),
            shuffle=bool(d.get("shuffle", True)),
            drop_remainder=bool(d.get("drop_remainder", True)),
            world_size=int(info.get("world_size") or 1),
            batch_size=int(t.get("per_device_train_batch_size", 4)),
            accum=int(t.get("gradient_accumulation_steps", 1)),
            epochs=None if int(t.get("max_steps", -1)) > 0 else int(t.get("num_train_epochs", 1)),
            steps=int(steps if steps is not None else (reached or 0)),
        )

    @property
    def per_rank(self) -> int:
        return rows_per_rank(self.count, self.world_size, self.drop_remainder)

    def locate(self, index: int, epoch: int) -> list[tuple[int, int]]:
        """Every (rank, position) the row at ``index`` is read at in ``epoch`` (none when
        dropped as remainder; two when the order wraps)."""
        block, offset = divmod(index, self.block_size)
        found = []
        for rank in range(self.world_size):
            pos = 0
            for piece in self._pieces(epoch, rank):
                if piece.block == block and piece.start <= offset < piece.stop:
                    found.append((rank, pos + piece.order().index(offset - piece.start)))
                pos += len(piece)
        return found

    def _pieces(self, epoch: int, rank: int) -> list[Any]:
        return rank_pieces(
            self.count,
            self.block_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            world_size=self.world_size,
            rank=rank,
            drop_remainder=self.drop_remainder,
        )


@dataclass
class Steps:
    """How a rank's rows became optimizer steps, as the loop does it: the one place that
    knows. The rank's epoch sequence is cut into ``batch_size`` batches (an epoch's last may
    be shorter); a batch whose rows were all skipped is not yielded; ``accum`` yielded
    batches, counted across epochs, make a step; every rank takes the same number of batches
    per step (the loop cuts a group to the shortest rank's), up to the run's last step."""

    plan: Plan
    skipped: Mapping[str, int]  # key_repr -> first epoch skipped
    keys: SnapshotKeys
    #: (rank, epoch) -> sorted batch numbers with every row skipped
    empty: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    #: key index -> first epoch skipped
    skipped_at: dict[int, int] = field(default_factory=dict)
    limit: float = 0.0  # batches each rank trained: steps * accum, or fewer at the end

    def __post_init__(self) -> None:
        p = self.plan
        if self.skipped:
            self.skipped_at = self._skipped_indexes()
            self.empty = self._empty_batches()
        self.limit = p.steps * p.accum
        if p.epochs is not None:  # a finite stream: the last group may be short on a rank
            per_epoch = math.ceil(p.per_rank / p.batch_size)
            totals = [
                p.epochs * per_epoch - sum(len(v) for (r, _), v in self.empty.items() if r == rank)
                for rank in range(p.world_size)
            ]
            self.limit = sum(
                min(min(max(t - s * p.accum, 0), p.accum) for t in totals) for s in range(p.steps)
            )

    def steps_of(self, rank: int, epoch: int, batches: np.ndarray) -> np.ndarray:
        """The step that trained each batch number of ``rank``'s ``epoch``; 0 where none did
        (every row skipped, or after the run's last step)."""
        p = self.plan
        per_epoch = math.ceil(p.per_rank / p.batch_size)
        empty = np.asarray(self.empty.get((rank, epoch), ()), dtype=np.int64)
        earlier = sum(len(v) for (r, e), v in self.empty.items() if r == rank and e < epoch)
        counter = epoch * per_epoch - earlier + batches - np.searchsorted(empty, batches)
        steps = counter // p.accum + 1
        steps[counter >= self.limit] = 0
        if len(empty):
            steps[np.isin(batches, empty)] = 0
        return steps

    def last_epoch(self) -> int:
        """An upper bound of the epochs the run read (exclusive)."""
        p = self.plan
        if p.epochs is not None:
            return p.epochs
        per_epoch = max(math.ceil(p.per_rank / p.batch_size), 1)
        skipped_batches = max((len(v) for v in self.empty.values()), default=0)
        return int(self.limit // per_epoch) + 2 + skipped_batches

    def _empty_batches(self) -> dict[tuple[int, int], list[int]]:
        p = self.plan
        most = int(p.steps * p.accum / max(math.ceil(p.per_rank / p.batch_size), 1) + 1)
        positions = Counter(
            (rank, epoch, pos // p.batch_size)
            for index, first in self.skipped_at.items()
            for epoch in range(first, p.epochs if p.epochs is not None else first + 1 + most)
            for rank, pos in p.locate(index, epoch)
        )
        empty: dict[tuple[int, int], list[int]] = {}
        for (rank, epoch, batch), n in sorted(positions.items()):
            if n >= min(p.batch_size, p.per_rank - batch * p.batch_size):
                empty.setdefault((rank, epoch), []).append(batch)
        return empty

    def _skipped_indexes(self) -> dict[int, int]:
        keys = itertools.chain.from_iterable(self.keys.chunks())
        reprs = (key_repr(key) for key in keys)
        return {i: int(self.skipped[r]) for i, r in enumerate(reprs) if r in self.skipped}

    # -- the walk --------------------------------------------------------------------------
    def batches(self, rank: int, span: int = 65_536) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """(step, rank, epoch, key indexes) of each step ``rank`` trained, in order: the epoch's
        positions are taken ``span`` at a time (a few whole pieces) and stepped with arrays."""
        p = self.plan
        skipped = np.fromiter(self.skipped_at, dtype=np.int64, count=len(self.skipped_at))
        firsts = np.fromiter(self.skipped_at.values(), dtype=np.int64, count=len(skipped))
        for epoch in range(self.last_epoch()):
            gone = skipped[firsts <= epoch]
            pieces: list[np.ndarray] = []
            held = start = 0
            for piece in [*p._pieces(epoch, rank), None]:
                if piece is not None:
                    base = piece.block * p.block_size + piece.start
                    pieces.append(base + np.asarray(piece.order(), dtype=np.int64))
                    held += len(piece)
                    if held < span:
                        continue
                if not pieces:
                    break
                indexes = np.concatenate(pieces)
                steps = self.steps_of(rank, epoch, (start + np.arange(held)) // p.batch_size)
                if len(gone):
                    steps[np.isin(indexes, gone)] = 0
                cut = np.flatnonzero(np.diff(steps)) + 1
                for first, stop in zip([0, *cut.tolist()], [*cut.tolist(), held]):
                    if steps[first]:
                        yield int(steps[first]), rank, epoch, indexes[first:stop]
                if steps[-1] == 0 and not len(gone) and start + held < p.per_rank:
                    return  # past the run's last step
                start += held
                pieces, held = [], 0

    def trained(self) -> np.ndarray:
        """A mask over the run's keys: which rows it trained at least once."""
        mask = np.zeros(self.plan.count, dtype=bool)
        for rank in range(self.plan.world_size):
            for *_, indexes in self.batches(rank):
                mask[indexes] = True
        return mask


class _Blocks:
    """Keys by index, a block read at a time (a walk visits a block's keys together)."""

    def __init__(self, keys: SnapshotKeys, block_size: int) -> None:
        self.keys, self.size = keys, block_size
        self.block, self.values = -1, cast(Sequence[Key], ())

    def __getitem__(self, index: int) -> Key:
        block = index // self.size
        if block != self.block:
            start = block * self.size
            self.block, self.values = block, self.keys.slice(start, start + self.size)
        return self.values[index - block * self.size]

    def take(self, indexes: np.ndarray) -> list[Key]:
        first = int(indexes[0]) // self.size
        if first == int(indexes[-1]) // self.size and (indexes // self.size == first).all():
            self[first * self.size]  # noqa: B018 - reads the block
            values = self.values
            return [values[i] for i in (indexes - first * self.size).tolist()]
        return [self[i] for i in indexes.tolist()]


def run_rows(steps: Steps) -> Iterator[Consumed]:
    """Every row the run trained, in step order (ranks interleaved within a step)."""
    plan = steps.plan
    streams = [steps.batches(rank) for rank in range(plan.world_size)]
    keys = [_Blocks(steps.keys, plan.block_size) for _ in range(plan.world_size)]
    run_id = plan.run_id
    for step, rank, epoch, indexes in heapq.merge(*streams, key=lambda b: (b[0], b[1])):
        for key in keys[rank].take(indexes):
            yield Consumed(key, epoch, step, rank, run_id)


def key_steps(steps: Steps, index: int) -> Iterator[tuple[int, int, int]]:
    """(epoch, step, rank) of every time the row at ``index`` was trained: O(epochs x ranks x
    blocks), no key read beyond the row's own."""
    plan = steps.plan
    last = min(steps.last_epoch(), steps.skipped_at.get(index, math.inf))  # skipped from then on
    for epoch in range(int(last)):
        for rank, pos in plan.locate(index, epoch):
            batch = np.array([pos // plan.batch_size], dtype=np.int64)
            if step := int(steps.steps_of(rank, epoch, batch)[0]):
                yield epoch, step, rank


# -- the stored runs ----------------------------------------------------------------------------
def run_keys(db: Database, run: Any) -> SnapshotKeys:
    """The training keys a run pinned; a run recorded before snapshots has none to give."""
    from llmtrain.data.snapshot import RunSnapshot

    record = run.info.get("snapshot")
    if not isinstance(record, dict):
        raise StoreError(
            f"run {run.run_id} of {run.identifier!r} recorded no key snapshot (it predates "
            "them): the rows it trained cannot be derived"
        )
    if not isinstance(run.info.get("config"), dict):
        raise StoreError(f"run {run.run_id} records no trainer config: no lineage to derive")
    view = RunSnapshot.from_record(record).view("train")
    if view.chunks:
        db.artifacts.require(view.chunks[0], run.info.get("artifacts"), f"run {run.run_id}")
    return SnapshotKeys(view, db.artifacts)


def reached_step(db: Database, run: Any) -> int:
    """The last step a run trained that is known: its final or reached step, or its newest
    checkpoint's while it is still running."""
    checkpoints = db.metadata.list_checkpoints(run.run_id)
    return max([int(run.info.get("steps") or 0), *(c.step for c in checkpoints)])


def run_steps(
    db: Database, run: Any, steps: int | None = None, keys: SnapshotKeys | None = None
) -> Steps:
    keys = run_keys(db, run) if keys is None else keys
    plan = Plan.of_run(run, keys.count, reached_step(db, run) if steps is None else steps)
    return Steps(plan, run.info.get(SKIPPED) or {}, keys)


def chain(db: Database, run_id: str, steps: int | None = None) -> list[tuple[Any, int | None]]:
    """The run and the runs it continued from (incremental fits), oldest first, each with
    the step its successor started from (None: the run's own last step)."""
    out: list[tuple[Any, int | None]] = []
    next_id: str | None = run_id
    while next_id is not None:
        if next_id in {run.run_id for run, _ in out}:
            raise StoreError(f"run {next_id} is its own ancestor: its record was edited")
        run = db.metadata.get_run(next_id)
        out.append((run, steps))
        parent = run.info.get(PARENT)
        next_id = parent.get("run_id") if isinstance(parent, dict) else None
        steps = parent.get("steps") if isinstance(parent, dict) else None
    return out[::-1]


def model_lineage(db: Database, name: str, version: int | None = None) -> Iterator[Consumed]:
    """The rows that trained a model version, parents' runs first, each run in step order:
    streamed, a few blocks of keys in memory at a time."""
    record = db.metadata.get_component("model", name, version)
    for run, steps in chain(db, record.payload["run_id"]):
        yield from run_rows(run_steps(db, run, steps))


def forgotten_keys(db: Database, source: Any) -> list[str]:
    """The keys (as key_repr) forgotten in ``source``: a stored query, a table or collection
    name, or a query."""
    from llmtrain.db.queries import Query

    # ordered by version: the newest record of each source wins
    newest = {r.identifier: r for r in db.metadata.list_components(FORGOTTEN)}
    out: set[str] = set()
    for record in newest.values():
        theirs = record.payload.get("source")
        theirs = Query.from_dict(theirs) if isinstance(theirs, dict) else theirs
        mine = source.to_dict() if isinstance(source, Query) else source
        if (
            matches(mine, theirs)
            if isinstance(mine, dict)
            else mine == theirs or (isinstance(theirs, Query) and matches(theirs.to_dict(), mine))
        ):
            out.update(record.payload.get("keys") or [])
    return sorted(out)


def matches(query: dict[str, Any], source: Any) -> bool:
    """Whether a stored query reads ``source``: a table or collection name (``schema.name``
    for a table in a schema), or a query (the same table, collection or SQL text)."""
    from llmtrain.db.queries import Query

    if isinstance(source, Query):
        theirs = source.to_dict()
        fields = ("kind", "text") if "text" in theirs else ("kind", "name", "schema")
        return all(query.get(f) == theirs.get(f) for f in fields)
    if "name" not in query:  # raw SQL: only the query itself names it
        return False
    name = query.get("name")
    return source in (name, f"{query.get('schema')}.{name}")


@dataclass(frozen=True)
class Use:
    """A run trained the row ``key`` at ``step`` (in ``epoch``, on ``rank``)."""

    key: Key
    run_id: str
    trainer: str
    version: int
    epoch: int
    step: int
    rank: int


@dataclass
class TrainedOn:
    """Every run, checkpoint and model version that consumed some rows. A checkpoint at step
    S consumed the rows up to its step; a run continued from an affected model (incremental)
    is affected from its first step, and so are its checkpoints and model."""

    source: Any
    keys: list[Key]
    uses: list[Use] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)  # every affected run, oldest first
    checkpoints: list[Any] = field(default_factory=list)  # CheckpointRecords
    models: list[tuple[str, int]] = field(default_factory=list)
    underivable: list[str] = field(default_factory=list)  # runs of the source with no snapshot
    forgotten: list[Key] = field(default_factory=list)  # of ``keys``, those db.forget forgot

    def __bool__(self) -> bool:
        """Whether any run trained on the rows: an answer of none is falsy."""
        return bool(self.uses or self.runs)


def trained_on(db: Database, source: Any, keys: Sequence[Key]) -> TrainedOn:
    """Who consumed the rows ``keys`` of ``source``.

    Cost: one listing of runs and of models; for each run that read ``source``, one pass over
    its snapshot, chunk by chunk (never the table), comparing 8-byte key digests, then
    O(epochs x ranks x blocks) plan arithmetic per key found; checkpoints are listed for the
    affected runs only.
    """
    result = TrainedOn(source, list(keys))
    forgotten = set(forgotten_keys(db, source))
    result.forgotten = [k for k in keys if key_repr(k) in forgotten]
    runs = db.metadata.list_runs("trainer")
    first: dict[str, int] = {}  # run -> the first step that consumed a row (or inherited it)
    for run in runs:
        if not matches(run.info.get("query") or {}, source):
            continue
        try:
            snapshot = run_keys(db, run)
        except StoreError:
            result.underivable.append(run.run_id)
            continue
        found = _find(snapshot, keys)
        if not found:
            continue
        steps = run_steps(db, run, keys=snapshot)
        uses = [
            Use(key, run.run_id, run.identifier, run.version, epoch, step, rank)
            for index, key in found
            for epoch, step, rank in key_steps(steps, index)
        ]
        for use in sorted(uses, key=lambda u: (u.step, u.rank)):
            result.uses.append(use)
            first[run.run_id] = min(first.get(run.run_id, use.step), use.step)
    for run in runs:  # oldest first: a parent is settled before the runs continuing from it
        parent = run.info.get(PARENT)
        parent = parent if isinstance(parent, dict) else {}
        if int(parent.get("steps") or 0) >= first.get(parent.get("run_id", ""), math.inf):
            first[run.run_id] = 0
    for run in runs:
        if run.run_id in first:
            result.runs.append(run.run_id)
            result.checkpoints += [
                c for c in db.metadata.list_checkpoints(run.run_id) if c.step >= first[run.run_id]
            ]
    result.models = [
        (m.identifier, m.version)
        for m in db.metadata.list_components("model")
        if m.payload.get("run_id") in first
    ]
    return result


def _find(keys: SnapshotKeys, wanted: Sequence[Key]) -> list[tuple[int, Key]]:
    """(index, key) of every key of ``keys`` in ``wanted``, of the same type (``1`` is not
    ``True``): a set lookup per key, about 50 ms per million."""
    from llmtrain.data.snapshot import same_key

    lookup = {k: k for k in wanted}
    found, base = [], 0
    for chunk in keys.chunks():
        found += [
            (base + i, k) for i, k in enumerate(chunk) if k in lookup and same_key(k, lookup[k])
        ]
        base += len(chunk)
    return found
