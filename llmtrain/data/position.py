"""Where a reader stands in a dataset's epochs: the one owner of (epoch, rows consumed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Positioned = tuple[int, Any, Any]  # (index in the rank's epoch sequence, key, row or None)


@dataclass
class Position:
    """The epoch being read and the rows of it handed out (skipped ones included); a pass
    run to its end sets ``completed``, so the next pass (and a resume) starts the next epoch."""

    epoch: int = 0
    consumed: int = 0
    completed: bool = False

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0
        self.completed = False

    def begin(self) -> tuple[int, int]:
        if self.completed:
            self.epoch, self.consumed, self.completed = self.epoch + 1, 0, False
        return self.epoch, self.consumed

    def finish(self, length: int) -> None:
        self.consumed, self.completed = length, True

    def resume_point(self) -> tuple[int, int]:
        return (self.epoch + 1, 0) if self.completed else (self.epoch, self.consumed)

    def restore(self, epoch: int, consumed: int) -> None:
        self.epoch, self.consumed, self.completed = int(epoch), int(consumed), False
