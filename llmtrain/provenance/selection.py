"""Which rows a new run trains on (its snapshot, forgotten rows left out by the database; less, for
an incremental fit, trained rows) and what it records of its sources. Key sets are sorted 8-byte
digest arrays (``np.isin``): 80 MB for 10M keys, a Python set ~1 GB."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from llmtrain.config.args import build
from llmtrain.data.snapshot import RunSnapshot, ViewWriter, decode_chunk, take_snapshot
from llmtrain.db.keys import Key, in_sorted, key_digests
from llmtrain.db.queries import Mix, Query, RawSQL
from llmtrain.db.sources import Source
from llmtrain.errors import ComponentNotFoundError, ConfigError, QueryError, StoreError
from llmtrain.provenance.lineage import FORGOTTEN, PARENT, RunLineage, chain, forgotten

if TYPE_CHECKING:
    from llmtrain.config.args import TrainerConfig
    from llmtrain.stores.handle import Database

log = logging.getLogger("llmtrain.training")


def pair_digests(keys: Sequence[Key] | np.ndarray, versions: Any) -> np.ndarray:
    """Digests of (key, version) pairs: a row changed in place gets a new one."""
    with np.errstate(over="ignore"):
        return key_digests(keys) ^ key_digests(versions) * np.uint64(0x9E3779B97F4A7C15)


@dataclass
class Trained:
    """Earlier runs' rows as sorted digest arrays (the largest run's, the nights since merged):
    keys (runs without versions) and pairs, (key, version) or, for a fit without versions, keys."""

    keys: list[np.ndarray]
    pairs: list[np.ndarray]
    runs: list[str]

    def new(self, keys: Sequence[Key] | np.ndarray, versions: Any) -> np.ndarray:
        """A mask of the rows none of those runs trained on (in the same version)."""
        mine = key_digests(keys)
        pairs = mine if versions is None else pair_digests(keys, versions)
        old = np.zeros(len(mine), dtype=bool)
        for wanted, trained in [(mine, a) for a in self.keys] + [(pairs, a) for a in self.pairs]:
            old |= in_sorted(trained, wanted)
        return ~old


def trained_by(db: Database, identifier: str, source: str, versions: bool) -> tuple[Trained, Any]:
    """What the completed runs of trainer ``identifier`` on ``source`` trained on (each row in
    the version read; the arrays a fit with or without ``versions`` compares), and the newest
    model they made (None: none): arrays kept beside each run's record, not history."""
    finished = {
        r.run_id: r
        for r in db.metadata.list_runs("trainer", identifier)
        if r.status == "completed" and r.info.get("source") == source
    }
    names = ("keys", "pairs" if versions else "pair_keys")
    each = [run_trained(db, run, names) for run in finished.values()]
    keys, pairs = [_two(list(a)) for a in zip(*each)] if each else ([], [])
    models = reversed(db.metadata.list_components("model", identifier))
    parent = next((m for m in models if m.payload.get("run_id") in finished), None)
    return Trained(keys, pairs, list(finished)), parent


def _two(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The largest array, and the rest (the nights since) merged: two searches however many."""
    arrays = sorted(arrays, key=len)
    rest = [np.unique(np.concatenate(arrays[:-1]))] if len(arrays) > 1 else []
    return [arrays[-1], *rest]


_TRAINED = ("keys", "pairs", "pair_keys")


def run_trained(db: Database, run: Any, names: Sequence[str] = _TRAINED) -> tuple[np.ndarray, ...]:
    """The run's trained rows as sorted digests (``names`` of keys, pairs, pair keys): from the
    artifact its record names (``trained``), else derived from its lineage once and kept."""
    if blob := run.info.get("trained"):
        try:
            with np.load(io.BytesIO(db.artifacts.get_bytes(blob)), allow_pickle=False) as kept:
                return tuple(kept[name] for name in names)
        except (StoreError, ValueError, KeyError, OSError) as exc:
            log.warning("run %s: its trained rows' digests are unreadable (%s)", run.run_id, exc)
    lineage = RunLineage.of(db, run)
    view, store, mask = lineage.view, lineage.store, lineage.trained()
    parts: dict[str, list[np.ndarray]] = {name: [] for name in _TRAINED}
    for c, chunk in enumerate(view.chunks):
        start = c * view.chunk_size
        kept = np.flatnonzero(mask[start : start + view.chunk_size])
        keys = decode_chunk(store.get_bytes(chunk))[kept]
        keys = keys if keys.dtype == np.int64 else keys.tolist()
        if view.versions is None:
            parts["keys"].append(key_digests(keys))
            continue
        read = decode_chunk(store.get_bytes(view.versions[c]))[kept].tolist()
        versions = [lineage.last_version(start + i, v) for i, v in zip(kept.tolist(), read)]
        parts["pairs"].append(pair_digests(keys, versions))
        parts["pair_keys"].append(key_digests(keys))
    empty = np.zeros(0, dtype=np.uint64)
    arrays = {name: np.unique(np.concatenate([empty, *parts[name]])) for name in _TRAINED}
    out = io.BytesIO()
    np.savez(out, **arrays)  # type: ignore[arg-type]
    db.metadata.update_run(run.run_id, info={"trained": db.artifacts.put_bytes(out.getvalue())})
    log.info("run %s: its trained rows' digests derived from its lineage and kept", run.run_id)
    return tuple(arrays[name] for name in names)


def keep_rows(view: Any, store: Any, new: Callable[[Any, Any], np.ndarray]) -> Any:
    """A new KeySnapshot of the keys of ``view`` that ``new(keys, versions)`` marks, asked of 64
    chunks (1M keys, sorted, search with more locality than 16k) and versions as decoded arrays."""

    def read(ids: Sequence[str]) -> np.ndarray:
        return np.concatenate([decode_chunk(store.get_bytes(i)) for i in ids])

    writer, step = ViewWriter(store, view.chunk_size, view.versions is not None), 64
    for c in range(0, len(view.chunks), step):
        keys = read(view.chunks[c : c + step])
        versions = None if view.versions is None else read(view.versions[c : c + step])
        kept = np.flatnonzero(new(keys if keys.dtype == np.int64 else keys.tolist(), versions))
        picked = keys[kept] if keys.dtype == np.int64 else keys[kept].tolist()
        writer.extend(picked, None if versions is None else versions[kept].tolist())
    return writer.done()


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
    carried = {r: k for r, k in forgotten(db, None)[1].items() if r in runs}
    if carried and not allow_forgotten:
        shown = sorted({k for keys in carried.values() for k in keys})
        raise ConfigError(
            f"{name} trained on rows forgotten since "
            f"({', '.join(shown[:10])}{', ...' if len(shown) > 10 else ''}): "
            "retrain it without them (db.forget(..., retrain=True)), or pass "
            "allow_forgotten_parent=True to continue from it anyway (recorded on the run)"
        )


def eval_rows(db: Database, config: TrainerConfig) -> RunSnapshot | None:
    """The snapshot of ``fit(eval_select=)``'s rows (None: no eval_select); forgotten rows the
    database left out, as from every selection."""
    query = config.fit.eval_query() if config.fit else None
    if query is None:
        return None
    return take_snapshot(db, query, version_column=config.data_args.version_column)


def run_source(db: Database, query: Query) -> Source:
    """The table a selection's keys are the keys of; for a key no table has (computed, a
    subquery's, a union's), the selection itself: its lineage is derived by the database."""
    try:
        return db.backend.resolve(query)
    except QueryError:
        if not isinstance(query, RawSQL):
            raise
        return Source(f"query {query.fingerprint()[:16]}", query.key, None, traced=False)


def _sources(db: Database, query: Query) -> dict[str, Any]:
    """What a run records of where its rows come from: each source's table and whether its keys
    are that table's own, the tables it reads (views expanded) and the forgets in force there."""
    parts = [p.select for p in query.parts] if isinstance(query, Mix) else [query]
    found = [run_source(db, q) for q in parts]
    reads = [db.backend.reads(q) for q in parts]
    tables = {t for r in reads for t in r or ()}
    forgets: dict[str, dict[str, int]] = {}
    for record in db.metadata.list_components(FORGOTTEN):
        if record.payload.get("source") in tables:
            mine = forgets.setdefault(record.identifier, {"keys": 0, "version": 0})
            mine["keys"] += len(record.payload.get("digests") or ())
            mine["version"] = max(mine["version"], record.version)
    ids = [s.identity for s in found]
    info: dict[str, Any] = {"sources": ids} if isinstance(query, Mix) else {"source": ids[0]}
    info |= {"direct": [s.traced for s in found], "reads": reads}
    return info | ({"forgets": forgets} if forgets else {})


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
    if isinstance(query, Mix) and incremental:
        raise ConfigError(
            "fit(incremental=True) with select=lt.mix(...): incremental fits continue "
            "one source's new rows; fit the mixture in full"
        )
    info = _sources(db, query)
    if isinstance(query, Mix):
        return snapshot, info
    source = info["source"]
    trained = parent = None
    if incremental:
        if config.lora_args is None:
            raise ConfigError(
                "fit(incremental=True) continues from the newest model's adapter; a fully "
                "fine-tuned trainer (lora_args=None) has none"
            )
        trained, parent = trained_by(
            db, config.identifier, source, snapshot.train.versions is not None
        )
        if parent is not None:
            check_parent(db, config, parent, allow_forgotten_parent)
    if parent is None and config.init_from is not None:  # the first run from an earlier model
        parent = starting_model(db, config.init_from)
        check_parent(db, config, parent, allow_forgotten_parent, f"init_from={config.init_from!r}")
    if trained is not None:
        view = keep_rows(snapshot.train, db.artifacts, trained.new)
        log.info("%s: %d row(s) trained before left out", source, snapshot.train.count - view.count)
        snapshot = replace(snapshot, train=view)
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
