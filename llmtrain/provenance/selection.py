"""Which rows a new run trains on: its snapshot less forgotten (incrementally, trained) rows. Key
sets are sorted 8-byte digest arrays (``np.isin``): 80 MB for 10M keys, a Python set ~1 GB."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from llmtrain.config.args import build
from llmtrain.data.snapshot import MixedView, RunSnapshot, ViewWriter, tagged, take_snapshot
from llmtrain.db.keys import Key, key_digests, key_repr
from llmtrain.db.queries import Conversations, Mix, Query, Table
from llmtrain.errors import ComponentNotFoundError, ConfigError, DataError, QueryError
from llmtrain.provenance.lineage import PARENT, RunLineage, chain, forgotten

if TYPE_CHECKING:
    from llmtrain.config.args import TrainerConfig
    from llmtrain.data.snapshot import KeySnapshot
    from llmtrain.stores.handle import Database

log = logging.getLogger("llmtrain.training")


def pair_digests(keys: Sequence[Key] | np.ndarray, versions: Sequence[Any]) -> np.ndarray:
    """Digests of (key, version): a row changed in place gets a new one."""
    return key_digests([f"{key_repr(k)}\x00{key_repr(v)}" for k, v in zip(keys, versions)])


@dataclass
class Trained:
    """Sorted digests of earlier runs' rows: keys (runs without versions), (key, version) pairs."""

    keys: np.ndarray
    pairs: np.ndarray
    pair_keys: np.ndarray  # the keys of ``pairs``: what a fit without versions compares
    runs: list[str]

    def new(self, keys: Sequence[Key], versions: Sequence[Any] | None) -> np.ndarray:
        """A mask of the rows none of those runs trained on (in the same version)."""
        mine = key_digests(keys)
        fresh = ~np.isin(mine, self.keys)
        if versions is None:  # no version column: only unseen keys are new
            return fresh & ~np.isin(mine, self.pair_keys)
        return fresh & ~np.isin(pair_digests(keys, versions), self.pairs)


def trained_by(db: Database, identifier: str, source: str) -> tuple[Trained, Any]:
    """What the completed runs of trainer ``identifier`` on ``source`` trained on (each row in
    the version read for training), and the newest model they made (None: none)."""
    empty = np.zeros(0, dtype=np.uint64)
    keys, pairs, pair_keys = [empty], [empty], [empty]
    finished = {
        r.run_id: r
        for r in db.metadata.list_runs("trainer", identifier)
        if r.status == "completed" and r.info.get("source") == source
    }
    for run in finished.values():
        lineage = RunLineage.of(db, run)
        view, mask = lineage.view, lineage.trained()
        for start in range(0, view.count, view.chunk_size):
            stop = min(start + view.chunk_size, view.count)
            kept = np.flatnonzero(mask[start:stop])
            chunk_keys = view.keys_at(db.artifacts, start + kept)
            if view.versions is None:
                keys.append(key_digests(chunk_keys))
            else:
                read = view.versions_of(db.artifacts, start, stop)
                versions = [lineage.last_version(start + i, read[i]) for i in kept.tolist()]
                pairs.append(pair_digests(chunk_keys, versions))
                pair_keys.append(key_digests(chunk_keys))
    models = reversed(db.metadata.list_components("model", identifier))
    parent = next((m for m in models if m.payload.get("run_id") in finished), None)
    k, p, pk = (np.unique(np.concatenate(parts)) for parts in (keys, pairs, pair_keys))
    return Trained(k, p, pk, list(finished)), parent


def keep_rows(
    view: Any, store: Any, gone: np.ndarray, new: Callable[[Any, Any], np.ndarray] | None = None
) -> tuple[Any, list[Key]]:
    """A new KeySnapshot of the keys of ``view`` not in ``gone`` (digests) and, with ``new``,
    marked by ``new(keys, versions)``; and the keys ``gone`` left out."""
    has_versions = view.versions is not None
    writer = ViewWriter(store, view.chunk_size, has_versions)
    excluded: list[Key] = []
    for start in range(0, view.count, view.chunk_size):
        keys = view.keys(store, start, start + view.chunk_size)
        versions = view.versions_of(store, start, start + view.chunk_size) if has_versions else None
        out = np.isin(key_digests(keys), gone)
        excluded += [keys[i] for i in np.flatnonzero(out).tolist()]
        kept = np.flatnonzero(~out if new is None else ~out & new(keys, versions)).tolist()
        writer.extend([keys[i] for i in kept], [versions[i] for i in kept] if versions else [])
    return writer.done(), excluded


#: a parent's adapter must have these as the continuing fit has them
_SAME_ADAPTER = ("r", "target_modules", "use_dora", "modules_to_save")


def starting_model(db: Database, named: str) -> Any:
    """The model record ``init_from`` names: ``"name"`` (its newest version) or ``"name:N"``."""
    name, _, number = named.rpartition(":")
    if not (name and number.isdigit()):
        name, number = named, ""
    try:
        return db.metadata.get_component("model", name, int(number) if number else None)
    except ComponentNotFoundError:
        which = f"{name!r} v{number}" if number else repr(name)
        raise ConfigError(f"init_from={named!r}: this database has no model {which}") from None


def pin_init_from(db: Database, config: TrainerConfig) -> TrainerConfig:
    """The config with ``init_from`` pinned to its version: a replay starts from the same model."""
    if config.init_from is None:
        return config
    model = starting_model(db, config.init_from)
    return config.model_copy(update={"init_from": f"{model.identifier}:{model.version}"})


def check_parent(
    db: Database,
    config: TrainerConfig,
    parent: Any,
    allow_forgotten: bool,
    asked: str = "fit(incremental=True)",
) -> None:
    """Refuse a parent model (continued as ``asked``) of another base or adapter shape, or whose
    lineage holds rows forgotten since (unless ``allow_forgotten``)."""
    run = db.metadata.get_run(parent.payload["run_id"])
    theirs = build(type(config), run.info["config"], f"run {run.run_id}")
    name = f"{asked}: the model {parent.identifier} v{parent.version}"
    for field_name in ("model_name_or_path", "revision"):
        a, b = getattr(theirs.model_args, field_name), getattr(config.model_args, field_name)
        if a != b:
            raise ConfigError(
                f"{name} was trained on "
                f"{field_name}={a!r}, this trainer has {b!r}; its adapter belongs to that base"
            )
    assert config.lora_args is not None
    for field_name in _SAME_ADAPTER:
        a, b = getattr(theirs.lora_args, field_name, None), getattr(config.lora_args, field_name)
        if a != b:
            raise ConfigError(
                f"{name} has an adapter with "
                f"{field_name}={a!r}, this trainer asks for {b!r}; an adapter continues only "
                "in its own shape (fit without incremental=True to train a new one)"
            )
    runs = {r.run_id for r, _ in chain(db, run.run_id)}
    source = run.info.get("source")
    carried = {r: k for r, k in forgotten(db, source)[1].items() if r in runs} if source else {}
    if carried and not allow_forgotten:
        shown = sorted({k for keys in carried.values() for k in keys})
        raise ConfigError(
            f"{name} trained on rows forgotten since "
            f"({', '.join(shown[:10])}{', ...' if len(shown) > 10 else ''} of {source}): "
            "retrain it without them (db.forget(..., retrain=True)), or pass "
            "allow_forgotten_parent=True to continue from it anyway (recorded on the run)"
        )


def check_resume(db: Database, run: Any) -> None:
    """Refuse to resume a run some of whose snapshot's rows were forgotten after it started: it
    would train them (a new fit leaves them out)."""
    sources = list(run.info.get("sources") or [run.info.get("source")])
    view = RunSnapshot.from_record(run.info["snapshot"]).view("train")
    parts = view.parts if isinstance(view, MixedView) else (view,)
    gone = 0
    for part, identity in zip(parts, sources):
        since = forgotten(db, identity, since=run.created_at)[0]
        if len(since):
            gone += sum(int(np.isin(d, since).sum()) for d in part.digests(db.artifacts))
    if gone:
        raise ConfigError(
            f"fit(resume=): {gone} row(s) of run {run.run_id}'s snapshot were forgotten "
            "(db.forget) after it started, and a resume trains its snapshot as it was: start a "
            "new fit without resume=, which leaves them out"
        )


def eval_rows(db: Database, config: TrainerConfig) -> RunSnapshot | None:
    """The snapshot of ``fit(eval_select=)``'s rows less forgotten ones (None: no eval_select)."""
    query = config.fit.eval_query() if config.fit else None
    if query is None:
        return None
    snapshot = take_snapshot(db, query, version_column=config.data_args.version_column)
    gone = forgotten_rows(db, query, db.backend.resolve(query).identity)
    if not len(gone):
        return snapshot
    return replace(snapshot, train=keep_rows(snapshot.train, db.artifacts, gone)[0])


def forgotten_rows(db: Database, query: Query, identity: str) -> np.ndarray:
    """Digests of the selection's forgotten rows: forgotten by its own key, and for
    conversations also each one holding a message forgotten by the message table's key."""
    gone, _ = forgotten(db, identity)
    if not isinstance(query, Conversations):
        return gone
    try:
        messages = db.backend.resolve(query.messages.name)  # keyed as the table is
    except QueryError:  # no single key column: no message was forgotten by one
        return gone
    by_message, _ = forgotten(db, messages.identity)
    if not len(by_message):
        return gone
    rows: Query = query.messages
    if isinstance(rows, Table):
        rows = Table(rows.name, schema=rows.schema, key=messages.key)
    held: list[Any] = []  # the conversations of those messages: one pass over keys
    for page in db.backend.key_pages(rows, query.by, 65_536):
        hit = np.flatnonzero(np.isin(key_digests(page.keys), by_message)).tolist()
        held += [page.versions[i] for i in hit] if page.versions else []
    return np.union1d(gone, key_digests(held)) if held else gone


def _mixed_rows(db: Database, query: Mix, snapshot: RunSnapshot) -> tuple[RunSnapshot, dict]:
    """A mixture's snapshot less each source's forgotten rows, and its sources' identities."""
    train, held = cast(MixedView, snapshot.train), cast("MixedView | None", snapshot.held)
    identities = [db.backend.resolve(part.select).identity for part in query.parts]
    excluded: list[str] = []
    views: list[list[KeySnapshot]] = [list(train.parts), list(held.parts if held else ())]
    for s, (part, identity) in enumerate(zip(query.parts, identities)):
        gone = forgotten_rows(db, part.select, identity)
        if not len(gone):
            continue
        views[0][s], out = keep_rows(views[0][s], db.artifacts, gone)
        excluded += [key_repr(tagged(s, k)) for k in out]
        if held:
            views[1][s] = keep_rows(views[1][s], db.artifacts, gone)[0]
    if not sum(v.count for v in views[0]):
        raise DataError(f"{query.source}: every row selected is forgotten: nothing to train on")
    held = MixedView(tuple(views[1])) if held else None
    snapshot = replace(snapshot, train=MixedView(tuple(views[0])), held=held)
    info: dict[str, Any] = {"sources": identities}
    return snapshot, info | ({"excluded_keys": sorted(excluded)} if excluded else {})


def select_rows(
    db: Database,
    config: TrainerConfig,
    snapshot: RunSnapshot,
    *,
    incremental: bool,
    allow_forgotten_parent: bool = False,
) -> tuple[RunSnapshot, dict[str, Any]]:
    """The run's snapshot less forgotten rows (and, incrementally, trained ones), and what
    to record on the run about it. Every refusal comes before anything is recorded."""
    assert config.fit is not None  # set by fit() before it registers
    query = config.fit.query()
    if isinstance(query, Mix):
        if incremental:
            raise ConfigError(
                "fit(incremental=True) with select=lt.mix(...): incremental fits continue "
                "one source's new rows; fit the mixture in full"
            )
        return _mixed_rows(db, query, snapshot)
    resolved = db.backend.resolve(query)
    source = resolved.identity
    gone = forgotten_rows(db, query, source)
    info: dict[str, Any] = {"source": source}
    trained = parent = None
    if incremental:
        if config.lora_args is None:
            raise ConfigError(
                "fit(incremental=True) continues from the newest model's adapter; a fully "
                "fine-tuned trainer (lora_args=None) has none"
            )
        trained, parent = trained_by(db, config.identifier, source)
        if parent is not None:
            check_parent(db, config, parent, allow_forgotten_parent)
    if parent is None and config.init_from is not None:  # the first run from an earlier model
        parent = starting_model(db, config.init_from)
        check_parent(db, config, parent, allow_forgotten_parent, f"init_from={config.init_from!r}")
    excluded: list[str] = []
    selected = snapshot.train.count
    if len(gone) or trained is not None:
        new = None if trained is None else trained.new
        view, out = keep_rows(snapshot.train, db.artifacts, gone, new)
        excluded = [key_repr(k) for k in out]
        snapshot = replace(snapshot, train=view)
        log.info("%s: %d of the selection's rows left out", resolved.name, selected - view.count)
    if len(gone) and snapshot.held is not None:  # nor are forgotten rows evaluated on
        snapshot = replace(snapshot, held=keep_rows(snapshot.held, db.artifacts, gone)[0])
    if excluded:
        info["excluded_keys"] = sorted(excluded)
    if excluded and len(excluded) == selected:
        raise DataError(
            f"{query.source} selects {selected} row(s), every one forgotten "
            f"(db.forget on {resolved.name}): nothing to train on"
        )
    if parent is not None:
        info[PARENT] = {
            "run_id": parent.payload["run_id"],
            "model_version": parent.version,
            "adapter": parent.payload.get("adapter"),
            "steps": db.metadata.get_run(parent.payload["run_id"]).info.get("steps"),
        }
        if allow_forgotten_parent:
            info["allow_forgotten_parent"] = True
    if trained is not None:
        info["incremental"] = {
            "trained_runs": trained.runs,
            "new_rows": snapshot.train.count,
            "detects": "changed rows" if config.data_args.version_column else "new keys only",
        }
    return snapshot, info
