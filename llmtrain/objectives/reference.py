"""DPO's and KTO's reference log-probabilities, computed once per pair (key and token ids) and
reference: a second epoch, a resume or another trainer runs no forward for a pair seen before, a
changed pair is computed again. A component per fingerprint lists its blobs (digest: values)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from llmtrain.db.keys import key_repr
from llmtrain.errors import ArtifactCorruptError, ArtifactNotFoundError, ComponentNotFoundError

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database

KIND = "reference_logps"
#: what a sequence scores, in each fingerprint: values kept before it changed are computed again
SCORING = "answers from where their ids leave the prompt's (TRL 1.16)"
#: a reference adapter: the adapter an earlier model trained, kept frozen beside the trained one
REFERENCE = "reference"


def pair_digest(key: Any, chosen: list[int], rejected: list[int]) -> str:
    """What a cached pair is found by: its key and both answers' token ids as trained."""
    return xxhash.xxh3_128_hexdigest(json.dumps([key_repr(key), chosen, rejected]).encode())


def reference_fingerprint(model_args: Any, precision: str, adapter: str | None = None) -> str:
    """The reference's identity: the base model (a local folder's files by size and time too: a
    folder rewritten in place is another reference), the precision and the adapter's id if any."""
    facts: list[Any] = [model_args.model_dump(mode="json"), precision, SCORING]
    if adapter is not None:
        facts.append(adapter)
    folder = Path(os.path.expanduser(model_args.model_name_or_path))
    if folder.is_dir():
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())]
        facts.append(stats)
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


class ReferenceCache:
    """The stored values of one reference, and those computed since :meth:`take_new`."""

    def __init__(self, db: Database, fingerprint: str) -> None:
        self.db, self.fingerprint = db, fingerprint
        self.values: dict[str, tuple[float, float]] = {}
        self.new: dict[str, tuple[float, float]] = {}
        for blob in self._blobs():  # one unreadable (in another machine's store) is a miss
            with contextlib.suppress(ArtifactNotFoundError, ArtifactCorruptError):
                pairs = json.loads(db.artifacts.get_bytes(blob))
                self.values.update({k: (c, r) for k, (c, r) in pairs.items()})

    def _blobs(self) -> list[str]:
        try:
            return list(self.db.metadata.get_component(KIND, self.fingerprint).payload["blobs"])
        except ComponentNotFoundError:
            return []

    def get(self, digests: list[str]) -> list[tuple[float, float]] | None:
        """Every pair's (chosen, rejected) values, or None when one is not kept."""
        return [self.values[d] for d in digests] if self.values.keys() >= set(digests) else None

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


@contextmanager
def reference_model(base: Any) -> Iterator[None]:
    """The reference: the :data:`REFERENCE` adapter, set on each LoRA layer (PEFT's ``set_adapter``
    would touch ``requires_grad`` under a wrapped model), else the base with its adapter off."""
    if REFERENCE not in getattr(base, "peft_config", {}):
        with base.disable_adapter():
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in base.modules() if isinstance(m, BaseTunerLayer)]
    active = [layer.active_adapters for layer in layers]
    for layer in layers:
        layer._active_adapter = [REFERENCE]
    try:
        yield
    finally:
        for layer, names in zip(layers, active):
            layer._active_adapter = names
