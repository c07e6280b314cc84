"""DPO's and KTO's reference log-probabilities, computed once per row and kept in the artifact
store, keyed by the row's key, its rendered token ids and the reference model's fingerprint: a
second epoch, a resume, a replay or another trainer on the same reference runs no reference
forward for a pair already seen, and a pair whose text changed is computed again (KTO's second
sequence pairs the prompt with its micro-batch neighbour's completion: kept for that pairing).
The index is a metadata component per fingerprint listing its blobs; each blob maps pair
digests to the two values."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from llmtrain.db.keys import key_repr
from llmtrain.errors import ComponentNotFoundError

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database

KIND = "reference_logps"


def pair_digest(key: Any, chosen: list[int], rejected: list[int]) -> str:
    """What a cached pair is found by: its key and both answers' token ids as trained."""
    return xxhash.xxh3_128_hexdigest(json.dumps([key_repr(key), chosen, rejected]).encode())


def reference_fingerprint(model_args: Any, precision: str, adapter: str | None = None) -> str:
    """The reference's identity: the base model (a local folder's weight files by size and
    time too, so a folder rewritten in place is another reference), the compute precision
    and the adapter it starts from (an earlier model's artifact id; None: the bare base)."""
    facts: list[Any] = [model_args.model_dump(mode="json"), precision]
    if adapter is not None:
        facts.append(adapter)
    folder = Path(os.path.expanduser(model_args.model_name_or_path))
    if folder.is_dir():
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())]
        facts.append(stats)
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


class ReferenceCache:
    """The stored values of one reference, and those this process computed since it last
    handed them over (:meth:`take_new`)."""

    def __init__(self, db: Database, fingerprint: str) -> None:
        self.db, self.fingerprint = db, fingerprint
        self.values: dict[str, tuple[float, float]] = {}
        self.new: dict[str, tuple[float, float]] = {}
        for blob in self._blobs():
            self.values.update(
                {k: (c, r) for k, (c, r) in json.loads(db.artifacts.get_bytes(blob)).items()}
            )

    def _blobs(self) -> list[str]:
        try:
            return list(self.db.metadata.get_component(KIND, self.fingerprint).payload["blobs"])
        except ComponentNotFoundError:
            return []

    def get(self, digests: list[str]) -> list[tuple[float, float]] | None:
        """Every pair's (chosen, rejected) values, or None when one is not kept."""
        if not all(d in self.values for d in digests):
            return None
        return [self.values[d] for d in digests]

    def add(self, digests: list[str], chosen: list[float], rejected: list[float]) -> None:
        for digest, c, r in zip(digests, chosen, rejected):
            self.values[digest] = self.new[digest] = (c, r)

    def take_new(self) -> dict[str, tuple[float, float]]:
        new, self.new = self.new, {}
        return new

    def store(self, new: dict[str, tuple[float, float]]) -> None:
        """Rank 0: one blob of the values every rank computed, added to the index."""
        if new:
            blob = self.db.artifacts.put_bytes(json.dumps(new, sort_keys=True).encode())
            self.db.metadata.add_component(
                KIND, self.fingerprint, {"blobs": [*self._blobs(), blob]}
            )
