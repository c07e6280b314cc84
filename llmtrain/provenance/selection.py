"""Which rows a new run trains on: the snapshot, less forgotten rows, and for an incremental
fit less the rows earlier runs of the trainer trained on.

Sets of keys are sorted arrays of 8-byte digests (:func:`digests`) tested
with ``np.isin``: 80 MB for 10M keys, where a Python set of keys takes about 1 GB.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from llmtrain.data.snapshot import key_repr
from llmtrain.db.backend import Key
from llmtrain.db.queries import Query
from llmtrain.errors import ConfigError
from llmtrain.provenance.lineage import PARENT, RunLineage, forgotten_keys, matches

if TYPE_CHECKING:
    from llmtrain.config.args import TrainerConfig
    from llmtrain.data.snapshot import RunSnapshot
    from llmtrain.stores.handle import Database

log = logging.getLogger("llmtrain.training")


def digests(keys: Sequence[Key]) -> np.ndarray:
    """uint64 digests of the keys' ``key_repr`` (blake2b); collisions are about n^2 / 2^65:
    1e-5 at 10M keys, in which case one changed row may be counted as trained already."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(key_repr(k).encode(), digest_size=8).digest(), "big")
            for k in keys
        ),
        dtype=np.uint64,
        count=len(keys),
    )


def pair_digests(keys: Sequence[Key], versions: Sequence[Any]) -> np.ndarray:
    """Digests of (key, version): a row changed in place gets a new one."""
    return digests([f"{k!r}\x00{v!r}" for k, v in zip(keys, versions)])


@dataclass
class Trained:
    """The rows earlier runs trained on: keys from runs that kept no versions, (key, version)
    pairs from runs that did, both sorted digest arrays."""

    keys: np.ndarray
    pairs: np.ndarray
    pair_keys: np.ndarray  # the keys of ``pairs``: what a fit without versions compares
    runs: list[str]

    def new(self, keys: Sequence[Key], versions: Sequence[Any] | None) -> np.ndarray:
        """A mask of the rows none of those runs trained on (in the same version)."""
        mine = digests(keys)
        fresh = ~np.isin(mine, self.keys)
        if versions is None:  # no version column: only unseen keys are new
            return fresh & ~np.isin(mine, self.pair_keys)
        return fresh & ~np.isin(pair_digests(keys, versions), self.pairs)


def trained_by(db: Database, identifier: str, query: dict[str, Any]) -> tuple[Trained, Any]:
    """What the completed runs of trainer ``identifier`` on the same source trained on, and
    the newest model they made (the parent of an incremental fit; None when there is none)."""
    empty = np.zeros(0, dtype=np.uint64)
    keys, pairs, pair_keys = [empty], [empty], [empty]
    finished = {
        r.run_id: r
        for r in db.metadata.list_runs("trainer", identifier)
        if r.status == "completed" and matches(r.info.get("query") or {}, Query.from_dict(query))
    }
    for run in finished.values():
        lineage = RunLineage.of(db, run)
        view, mask = lineage.view, lineage.trained()
        for start in range(0, view.count, view.chunk_size):
            stop = start + view.chunk_size
            kept = mask[start:stop]
            chunk_keys = [k for k, t in zip(view.keys(db.artifacts, start, stop), kept) if t]
            if view.versions is None:
                keys.append(digests(chunk_keys))
            else:
                versions = view.versions_of(db.artifacts, start, stop)
                pairs.append(pair_digests(chunk_keys, [v for v, t in zip(versions, kept) if t]))
                pair_keys.append(digests(chunk_keys))
    models = reversed(db.metadata.list_components("model", identifier))
    parent = next((m for m in models if m.payload.get("run_id") in finished), None)
    k, p, pk = (np.unique(np.concatenate(parts)) for parts in (keys, pairs, pair_keys))
    return Trained(k, p, pk, list(finished)), parent


def keep_rows(view: Any, store: Any, keep: Callable[[list[Key], list[Any] | None], Any]) -> Any:
    """A new KeySnapshot of the keys of ``view`` that ``keep(keys, versions)`` marks, chunk by
    chunk, written by the snapshot's own writer."""
    from llmtrain.data.snapshot import ViewWriter

    has_versions = view.versions is not None
    writer = ViewWriter(store, view.chunk_size, has_versions)
    for start in range(0, view.count, view.chunk_size):
        keys = view.keys(store, start, start + view.chunk_size)
        versions = view.versions_of(store, start, start + view.chunk_size) if has_versions else None
        kept = np.flatnonzero(np.asarray(keep(keys, versions), dtype=bool)).tolist()
        writer.extend([keys[i] for i in kept], [versions[i] for i in kept] if versions else [])
    return writer.done()


def select_rows(
    db: Database, config: TrainerConfig, snapshot: RunSnapshot, *, incremental: bool
) -> tuple[RunSnapshot, dict[str, Any]]:
    """The run's snapshot less forgotten rows (and, incrementally, trained ones), and what
    to record on the run about it: the parent, the excluded keys, the rows it leaves."""
    fit = config.fit
    assert fit is not None  # set by fit() before it registers
    forgotten = forgotten_keys(db, fit.select)
    info: dict[str, Any] = {}
    gone = np.unique(digests(forgotten))  # key_repr strings digest as their keys do
    trained = parent = None
    if incremental:
        if config.lora_args is None:
            raise ConfigError(
                "fit(incremental=True) continues from the newest model's adapter; a fully "
                "fine-tuned trainer (lora_args=None) has none"
            )
        trained, parent = trained_by(db, config.identifier, fit.select)

    def keep(keys: list[Key], versions: list[Any] | None) -> np.ndarray:
        mask = np.ones(len(keys), dtype=bool)
        if len(gone):
            mask &= ~np.isin(digests(keys), gone)
        if trained is not None:
            mask &= trained.new(keys, versions)
        return mask

    if forgotten or trained is not None:
        view = keep_rows(snapshot.train, db.artifacts, keep)
        dropped = snapshot.train.count - view.count
        snapshot = replace(snapshot, train=view)
        if forgotten:
            info["excluded_keys"] = forgotten
        log.info("%s: %d of the selection's rows left out", fit.query().source, dropped)
    if parent is not None:
        info[PARENT] = {
            "run_id": parent.payload["run_id"],
            "model_version": parent.version,
            "adapter": parent.payload.get("adapter"),
            "steps": db.metadata.get_run(parent.payload["run_id"]).info.get("steps"),
        }
    if trained is not None:
        info["incremental"] = {
            "trained_runs": trained.runs,
            "new_rows": snapshot.train.count,
            "detects": "changed rows" if config.data_args.version_column else "new keys only",
        }
    return snapshot, info
