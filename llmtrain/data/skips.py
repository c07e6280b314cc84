"""The rows a run skipped or read changed, recorded as it goes: the per-key facts its
lineage cannot derive from its plan.

A checkpoint writes what changed since the one before it (never the whole history again):
one JSON blob in the artifact store, ``{"skipped": [[key, first epoch], ...], "deleted":
[key, ...], "changed": [[key, version], ...]}`` (keys typed as a snapshot's chunks keep
them), whose id the run record appends to its ``skips`` list. A row is skipped when it is bad
(``on_bad_row="skip"``) or deleted since the snapshot; lineage leaves it out from the epoch
it was first skipped in. With a version column, a row whose version when read for training
differs from the snapshot's is recorded with the version read: what trained the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmtrain.data.snapshot import typed, untyped
from llmtrain.db.keys import Key, key_repr

#: run record field: the artifact ids of the skip records its checkpoints wrote, in order
SKIPS = "skips"


@dataclass
class Skips:
    """Rows skipped: each key with the first epoch it was skipped in, and which of them were
    deleted (keys kept with their types, as a snapshot keeps them)."""

    first: dict[str, tuple[Key, int]] = field(default_factory=dict)
    deleted: dict[str, Key] = field(default_factory=dict)
    changed: dict[str, tuple[Key, Any]] = field(default_factory=dict)  # the last version read

    def add(
        self,
        keys: Iterable[Key],
        epoch: int,
        deleted: Iterable[Key] = (),
        changed: Iterable[tuple[Key, Any]] = (),
    ) -> None:
        for key in keys:
            name = key_repr(key)
            if name not in self.first or self.first[name][1] > epoch:
                self.first[name] = (key, epoch)
        self.deleted.update((key_repr(k), k) for k in deleted)
        self.changed.update((key_repr(k), (k, v)) for k, v in changed)

    def merge(self, other: Skips) -> None:
        for key, epoch in other.first.values():
            self.add([key], epoch)
        self.deleted.update(other.deleted)
        self.changed.update(other.changed)

    def __bool__(self) -> bool:
        return bool(self.first or self.deleted or self.changed)

    def to_bytes(self) -> bytes:
        skipped = [[typed(k), e] for _, (k, e) in sorted(self.first.items())]
        deleted = [typed(k) for _, k in sorted(self.deleted.items())]
        changed = [[typed(k), typed(v)] for _, (k, v) in sorted(self.changed.items())]
        record = {"skipped": skipped, "deleted": deleted, "changed": changed}
        return json.dumps(record).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Skips:
        record = json.loads(data)
        found = cls()
        for item, epoch in record["skipped"]:
            found.add([untyped(item)], int(epoch))
        found.deleted = {key_repr(k): k for k in map(untyped, record["deleted"])}
        found.add((), 0, changed=((untyped(k), untyped(v)) for k, v in record.get("changed", ())))
        return found


def read_skips(store: Any, info: dict[str, Any]) -> Skips:
    """Everything a run recorded as skipped, from its record's ``skips`` blobs."""
    found = Skips()
    for artifact in info.get(SKIPS) or ():
        found.merge(Skips.from_bytes(store.get_bytes(artifact)))
    return found
