"""The rows a run skipped, recorded as it goes: the one per-key fact its lineage cannot
derive from its plan.

A checkpoint writes what changed since the one before it (never the whole history again):
one JSON blob in the artifact store, ``{"skipped": {key_repr: first epoch}, "deleted":
[key_repr, ...]}``, whose id the run record appends to its ``skips`` list. A row is skipped
when it is bad (``on_bad_row="skip"``) or deleted since the snapshot; lineage leaves it out
from the epoch it was first skipped in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: run record field: the artifact ids of the skip records its checkpoints wrote, in order
SKIPS = "skips"


@dataclass
class Skips:
    """Rows skipped: each key's first epoch, and which of them were deleted."""

    first: dict[str, int] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)

    def add(self, keys: Iterable[str], epoch: int, deleted: Iterable[str] = ()) -> None:
        for key in keys:
            self.first[key] = min(self.first.get(key, epoch), epoch)
        self.deleted.update(deleted)

    def merge(self, other: Skips) -> None:
        for key, epoch in other.first.items():
            self.first[key] = min(self.first.get(key, epoch), epoch)
        self.deleted |= other.deleted

    def __bool__(self) -> bool:
        return bool(self.first or self.deleted)

    def to_bytes(self) -> bytes:
        record = {"skipped": dict(sorted(self.first.items())), "deleted": sorted(self.deleted)}
        return json.dumps(record).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Skips:
        record = json.loads(data)
        return cls(dict(record["skipped"]), set(record["deleted"]))


def read_skips(store: Any, info: dict[str, Any]) -> Skips:
    """Everything a run recorded as skipped, from its record's ``skips`` blobs."""
    found = Skips()
    for artifact in info.get(SKIPS) or ():
        found.merge(Skips.from_bytes(store.get_bytes(artifact)))
    return found
