"""Row lineage, derived not logged: a run's rows and steps are a pure function of its record
(key snapshot, order, :class:`~llmtrain.data.plan.StepRule`, the step it reached); the rows it
skipped are the only per-key facts it records (:mod:`llmtrain.data.skips`)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from llmtrain.config.args import TrainerConfig, build
from llmtrain.data.cached import epoch_order
from llmtrain.data.plan import StepRule
from llmtrain.data.skips import read_skips
from llmtrain.data.snapshot import RunSnapshot, View, tagged
from llmtrain.db.backend import Key
from llmtrain.db.keys import in_sorted, key_digests, key_repr, same_key
from llmtrain.db.queries import Mix, Query
from llmtrain.db.sources import Source
from llmtrain.errors import ConfigError, QueryError, StoreError
from llmtrain.stores.artifacts import open_artifacts

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database

#: record field: the run this one continued from (an incremental fit): {run_id, steps, model}
PARENT = "parent"
FORGOTTEN = "forgotten"  # the metadata record type of a source's forgotten keys
_ROWS_AT_ONCE = 65_536  # rows() looks their keys up together


class Consumed(NamedTuple):
    """One row trained at one optimizer step of one run."""

    key: Key
    epoch: int
    step: int
    rank: int
    run_id: str


@dataclass
class RunLineage:
    """A run's derived lineage: its training keys, order, steps and skips."""

    run_id: str
    view: View
    store: Any
    rule: StepRule
    limit: int  # the last step the run trained
    skipped: dict[int, set[int]]  # key index -> the epochs it was skipped in
    changed: dict[int, dict[int, Any]] = field(default_factory=dict)  # index -> epoch: version

    @classmethod
    def of(cls, db: Database, run: Any, steps: int | None = None) -> RunLineage:
        """From the run's record (``steps``: where a successor continued from it)."""
        info = run.info
        if not isinstance(info.get("snapshot"), dict) or not isinstance(info.get("config"), dict):
            raise StoreError(
                f"run {run.run_id} of {run.identifier!r} recorded no key snapshot or config: "
                "the rows it trained cannot be derived"
            )
        view, store = run_view(db, run)
        config = build(TrainerConfig, info["config"], f"run {run.run_id}")
        d, t = config.data_args, config.training_args
        assert config.fit is not None
        order = epoch_order(view, config.fit.query(), d, t.seed, int(info.get("world_size") or 1))
        rows = t.per_device_train_batch_size * t.gradient_accumulation_steps
        rule = StepRule(order, rows, rows)
        if steps is None and run.status in ("created", "running"):  # may train any of its plan
            steps = t.max_steps if t.max_steps > 0 else rule.per_epoch * t.num_train_epochs
        if steps is None:  # its last known step: final or reached, or its newest checkpoint's
            checkpoints = db.metadata.list_checkpoints(run.run_id)
            steps = max([int(info.get("steps") or 0), *(c.step for c in checkpoints)])
        limit = int(steps)
        if t.max_steps <= 0:  # an epoch-bounded run never goes past its epochs
            limit = min(limit, rule.per_epoch * t.num_train_epochs)
        skips = read_skips(store, info)
        skipped = by_index(view, store, skips.skipped.values())
        changed = by_index(view, store, skips.changed.values())
        return cls(run.run_id, view, store, rule, limit, skipped, changed)

    def epochs(self) -> range:
        return range(self.rule.epoch_of(self.limit) + 1 if self.limit else 0)

    def _trained(self, epoch: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(key indexes, steps) of what ``rank`` trained in ``epoch``, in visit order."""
        indexes = self.rule.order.indexes(epoch, rank)
        steps = self.rule.steps(epoch, np.arange(len(indexes)))
        keep = steps <= self.limit
        if self.skipped:
            gone = [i for i, epochs in self.skipped.items() if epoch in epochs]
            keep &= ~np.isin(indexes, np.asarray(gone, dtype=np.int64))
        return indexes[keep], steps[keep]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, ranks, key indexes) of every row trained in ``epoch``, in step order."""
        parts = [self._trained(epoch, rank) for rank in range(self.rule.order.world_size)]
        ranks = np.concatenate([np.full(len(i), r) for r, (i, _) in enumerate(parts)])
        indexes = np.concatenate([i for i, _ in parts])
        steps = np.concatenate([s for _, s in parts])
        order = np.lexsort((ranks, steps))  # stable: visit order kept within a rank
        return steps[order], ranks[order], indexes[order]

    def rows(self) -> Iterator[Consumed]:
        """Every row the run trained, in step order, keys looked up a slice at a time."""
        for epoch in self.epochs():
            steps, ranks, indexes = self._epoch(epoch)
            for lo in range(0, len(steps), _ROWS_AT_ONCE):
                at = slice(lo, lo + _ROWS_AT_ONCE)
                keys = self.view.keys_at(self.store, indexes[at])
                for key, step, rank in zip(keys, steps[at].tolist(), ranks[at].tolist()):
                    yield Consumed(key, epoch, step, rank, self.run_id)

    def trained(self) -> np.ndarray:
        """A mask over the run's keys: which rows it trained at least once."""
        mask = np.zeros(self.view.count, dtype=bool)
        for epoch in self.epochs():
            mask[self._epoch(epoch)[2]] = True
        return mask

    def version_of(self, index: int, epoch: int) -> Any:
        """The row's version trained in ``epoch`` (recorded if it changed, else the snapshot's)."""
        if epoch in self.changed.get(index, {}) or self.view.versions is None:
            return self.changed.get(index, {}).get(epoch)
        return self.view.versions_at(self.store, np.array([index]))[0]

    def last_version(self, index: int, snapshot_version: Any) -> Any:
        """The version the run last read of the row (the snapshot's unless it changed)."""
        versions = self.changed.get(index)
        return versions[max(versions)] if versions else snapshot_version

    def uses_of(self, indexes: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
        """(index, epoch, step, rank) of every time rows ``indexes`` were trained: a few located
        one by one, many found in each epoch's whole order (100k keys of 10M: seconds)."""
        if len(indexes) <= 256:
            yield from ((i, *use) for i in indexes for use in self.uses(i))
            return
        wanted = np.unique(np.asarray(indexes, dtype=np.int64))
        for epoch in self.epochs():
            for rank in range(self.rule.order.world_size):
                order, steps = self._trained(epoch, rank)
                hit = np.isin(order, wanted, kind="table")  # indexes: a bitmap, no sort
                for i, step in zip(order[hit].tolist(), steps[hit].tolist()):
                    yield i, epoch, step, rank

    def uses(self, index: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, step, rank) of every time the row at ``index`` was trained."""
        for epoch in self.epochs():
            if epoch in self.skipped.get(index, ()):
                continue
            for rank, position in self.rule.order.locate(index, epoch):
                step = int(self.rule.steps(epoch, np.int64(position)))
                if step <= self.limit:
                    yield epoch, step, rank


def run_view(db: Database, run: Any) -> tuple[View, Any]:
    """The run's training keys and the store holding them: this connection's, else the one the
    run recorded (another machine's folder, a bucket), opened for reading."""
    view = RunSnapshot.from_record(run.info["snapshot"]).view("train")
    store, recorded = db.artifacts, run.info.get("artifacts")
    if view.chunks and not store.exists(view.chunks[0]) and recorded != store.location:
        try:
            store = open_artifacts(recorded)
        except ConfigError as exc:
            raise StoreError(
                f"run {run.run_id} stored its artifacts in {recorded}: {exc}"
            ) from None
    if view.chunks:
        store.require(view.chunks[0], recorded, f"run {run.run_id}")
    return view, store


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
    """The rows that trained a model version, parents' runs first, each in step order."""
    record = db.metadata.get_component("model", name, version)
    for run, steps in chain(db, record.payload["run_id"]):
        yield from RunLineage.of(db, run, steps).rows()


def forgotten(db: Database, source: str | None) -> tuple[np.ndarray, dict[str, list[str]]]:
    """What ``db.forget`` recorded for ``source`` (a :attr:`Source.identity`; None: every
    source): the sorted digests of its forgotten keys, and each affected run's keys."""
    digests: list[np.ndarray] = [np.zeros(0, dtype=np.uint64)]
    runs: dict[str, list[str]] = {}
    for record in db.metadata.list_components(FORGOTTEN, source):
        digests.append(np.asarray(record.payload.get("digests") or [], dtype=np.uint64))
        for run_id, keys in (record.payload.get("runs") or {}).items():
            runs[run_id] = sorted({*runs.get(run_id, ()), *keys})
    return np.unique(np.concatenate(digests)), runs


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
    row_version: Any = None  # the row's version as trained (with a version column)


@dataclass
class TrainedOn:
    """Every run, checkpoint (at or after the first step that consumed a row) and model that
    consumed some rows; a run continued from an affected model is affected from its start."""

    source: Any
    keys: list[Key]
    uses: list[Use] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)  # every affected run, oldest first
    checkpoints: list[Any] = field(default_factory=list)  # CheckpointRecords
    models: list[tuple[str, int]] = field(default_factory=list)
    underivable: list[str] = field(default_factory=list)  # runs of the source with no snapshot
    forgotten: list[Key] = field(default_factory=list)  # of ``keys``, those db.forget forgot

    def __bool__(self) -> bool:
        return bool(self.uses or self.runs)


def trained_on(db: Database, source: Any, keys: Sequence[Key]) -> TrainedOn:
    """Who consumed the rows ``keys`` of ``source`` (a name, a query or a :class:`Source`): one
    pass over each of its runs' snapshots (never the table) by key digests, then plan arithmetic."""
    found_source = source if isinstance(source, Source) else db.backend.resolve(source)
    keys = found_source.typed(keys, "trained_on()")
    result = TrainedOn(found_source.name, keys)
    gone = set(forgotten(db, found_source.identity)[0].tolist())
    result.forgotten = [k for k, d in zip(keys, key_digests(keys).tolist()) if d in gone]
    if found_source.traced and len(keys) <= 100:  # and as the rows spell them ("K5": "k5")
        spelled = [r for k in keys for r in db.backend.row_keys(found_source, k)]
        keys = list({key_repr(k): k for k in [*keys, *spelled]}.values())
    runs = db.metadata.list_runs("trainer")
    first: dict[str, int] = {}  # run -> the first step that consumed a row (or inherited it)
    own = {key_repr(k): k for k in keys}  # a run keyed by the table's own keys: built once
    own_asked, own_digests = {r: {r: k} for r, k in own.items()}, key_digests(list(own.values()))
    for run in runs:  # oldest first: a parent is settled before the runs continuing from it
        parent = run.info.get(PARENT)
        parent = parent if isinstance(parent, dict) else {}
        if int(parent.get("steps") or 0) >= first.get(parent.get("run_id", ""), math.inf):
            first[run.run_id] = 0
        mixed = "sources" in run.info  # a mixture's keys are tagged with their source
        asked, ours = own_asked, own  # a selection key -> the asked keys it comes of
        try:
            wanted = _wanted(db, run, found_source, keys)
            if wanted is not None:
                asked, ours = {}, {}
                for part, key, one in wanted:
                    selected = tagged(part, key) if mixed else key
                    ours[key_repr(selected)] = selected
                    asked.setdefault(key_repr(selected), {})[key_repr(one)] = one
            # the snapshot first: a run holding none of the keys costs a read of its chunks
            digests = own_digests if wanted is None else None
            hits = find(*run_view(db, run), list(ours.values()), digests) if ours else []
            if not hits:
                continue
            lineage = RunLineage.of(db, run)
        except (StoreError, QueryError):  # its snapshot, or a table it read, is gone
            result.underivable.append(run.run_id)
            continue
        key_at = {index: key for key, index in hits}
        uses = [
            Use(one, run.run_id, run.identifier, run.version, epoch, step, rank, v)
            for index, epoch, step, rank in lineage.uses_of(list(key_at))
            for v in [lineage.version_of(index, epoch)]  # the row's version as trained
            for one in asked[key_repr(key_at[index])].values()
        ]
        for use in sorted(uses, key=lambda u: (u.step, u.rank)):
            result.uses.append(use)
            first[run.run_id] = min(first.get(run.run_id, use.step), use.step)
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


def _wanted(
    db: Database, run: Any, source: Source, keys: Sequence[Key]
) -> list[tuple[int, Key, Key]] | None:
    """(part, selection key, the asked key it comes from) for each of ``keys`` of ``source`` the
    run's selection reads: its own keys where they are the table's (None: a one-source run
    keyed by them, the common case), else the keys the database derives from them (a join's,
    a view's, a conversation's), each asked key its own statement."""
    info = run.info
    sources = list(info["sources"]) if "sources" in info else [info.get("source")]
    reads = info.get("reads") or [[] for _ in sources]
    direct = info.get("direct") or [True for _ in sources]
    if sources == [source.identity] and direct[0]:
        return None
    out: list[tuple[int, Key, Key]] = []
    for part, (identity, read) in enumerate(zip(sources, reads)):
        if identity == source.identity and direct[part]:
            out += [(part, k, k) for k in keys]
        elif read is None:
            raise QueryError(f"run {run.run_id}: which tables its selection reads is unknown")
        elif source.name in read:
            select = Query.from_dict(info["query"])
            query = select.parts[part].select if isinstance(select, Mix) else select
            out += [(part, d, k) for k in keys for d in db.backend.derived_keys(query, source, [k])]
    return out


def find(
    view: View, store: Any, keys: Sequence[Key], digests: np.ndarray | None = None
) -> list[tuple[Key, int]]:
    """(key, index) of each of ``keys`` in ``view`` (same type: ``1`` is not ``True``), found by
    digests chunk by chunk (10M int keys well under a second), each match confirmed on the key."""
    if not len(keys):
        return []
    wanted = key_digests(list(keys)) if digests is None else digests
    by_digest = dict(zip(wanted.tolist(), keys))
    wanted = np.sort(wanted)
    found, base = [], 0
    for chunk in view.digests(store):
        at = np.flatnonzero(in_sorted(wanted, chunk))
        if len(at):  # the chunk's keys at those places, read together
            for i, key in zip(at.tolist(), view.keys_at(store, base + at)):
                if same_key(key, by_digest[int(chunk[i])]):
                    found.append((key, base + i))
        base += len(chunk)
    return found


def by_index(view: View, store: Any, pairs: Collection[tuple[Key, Any]]) -> dict[int, Any]:
    """The values of (key, value) ``pairs`` by their key's index in ``view``."""
    values = {key_repr(k): v for k, v in pairs}
    return {i: values[key_repr(k)] for k, i in find(view, store, [k for k, _ in pairs])}
