"""The rows a run skipped (bad or deleted) or read changed: the per-key facts lineage cannot
derive from the plan, each for the epoch it happened in (a row fixed or re-inserted later trains
in later epochs). Each checkpoint appends one JSON blob of what is new since the last:
``{"skipped": [[key, epoch], ...], "deleted": [key, ...], "changed": [[key, version, epoch]]}``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmtrain.data.snapshot import Blobs, typed, untyped
from llmtrain.db.keys import Key, key_repr

#: run record field: the artifact ids of the skip records its checkpoints wrote, in order
SKIPS = "skips"


@dataclass
class Skips:
    """Skipped keys (with their epochs), deleted keys, changed keys (with each epoch's version)."""

    skipped: dict[str, tuple[Key, set[int]]] = field(default_factory=dict)
    deleted: dict[str, Key] = field(default_factory=dict)
    changed: dict[str, tuple[Key, dict[int, Any]]] = field(default_factory=dict)

    def add(
        self,
        keys: Iterable[Key],
        epoch: int,
        deleted: Iterable[Key] = (),
        changed: Iterable[tuple[Key, Any]] = (),
    ) -> None:
        for key in keys:
            self.skipped.setdefault(key_repr(key), (key, set()))[1].add(epoch)
        self.deleted.update((key_repr(k), k) for k in deleted)
        for key, version in changed:
            self.changed.setdefault(key_repr(key), (key, {}))[1][epoch] = version

    def merge(self, other: Skips) -> None:
        for at, (key, epochs) in other.skipped.items():
            self.skipped.setdefault(at, (key, set()))[1].update(epochs)
        self.deleted.update(other.deleted)
        for at, (key, versions) in other.changed.items():
            self.changed.setdefault(at, (key, {}))[1].update(versions)

    def __bool__(self) -> bool:
        return bool(self.skipped or self.deleted or self.changed)

    def to_bytes(self) -> bytes:
        skipped = [[typed(k), e] for _, (k, es) in sorted(self.skipped.items()) for e in sorted(es)]
        deleted = [typed(k) for _, k in sorted(self.deleted.items())]
        changed = [
            [typed(k), typed(v), e]
            for _, (k, versions) in sorted(self.changed.items())
            for e, v in sorted(versions.items())
        ]
        return json.dumps({"skipped": skipped, "deleted": deleted, "changed": changed}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Skips:
        record = json.loads(data)
        found = cls()
        for item, epoch in record["skipped"]:
            found.add([untyped(item)], int(epoch))
        found.deleted = {key_repr(k): k for k in map(untyped, record["deleted"])}
        for key, version, epoch in record["changed"]:
            found.add((), int(epoch), changed=[(untyped(key), untyped(version))])
        return found


def read_skips(store: Blobs, info: dict[str, Any]) -> Skips:
    """Everything a run recorded as skipped, from its record's ``skips`` blobs."""
    found = Skips()
    for artifact in info.get(SKIPS) or ():
        found.merge(Skips.from_bytes(store.get_bytes(artifact)))
    return found
