"""The rows a run skipped (bad or deleted) or read changed: the per-key facts lineage cannot
derive from the plan. Each checkpoint appends one JSON blob of what is new since the last:
``{"skipped": [[key, first epoch], ...], "deleted": [key, ...], "changed": [[key, version]]}``."""

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
    """Skipped keys (and first epoch skipped), deleted keys, changed keys (and version read)."""

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
        return json.dumps({"skipped": skipped, "deleted": deleted, "changed": changed}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Skips:
        record = json.loads(data)
        found = cls()
        for item, epoch in record["skipped"]:
            found.add([untyped(item)], int(epoch))
        found.deleted = {key_repr(k): k for k in map(untyped, record["deleted"])}
        found.add((), 0, changed=((untyped(k), untyped(v)) for k, v in record.get("changed", ())))
        return found


def read_skips(store: Blobs, info: dict[str, Any]) -> Skips:
    """Everything a run recorded as skipped, from its record's ``skips`` blobs."""
    found = Skips()
    for artifact in info.get(SKIPS) or ():
        found.merge(Skips.from_bytes(store.get_bytes(artifact)))
    return found
