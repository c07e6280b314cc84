"""The epoch order, a pure function of (seed, epoch, count, block, world size): blocks of keys
permuted, each rank a contiguous run, rows shuffled inside each piece; and the rule from rows
to steps. No state between epochs, so resume and lineage are arithmetic (NumPy over blocks)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_SALT_BLOCKS = 0x6C74_0001
_SALT_PIECE = 0x6C74_0002


def rows_per_rank(count: int, world_size: int, drop_remainder: bool) -> int:
    """Equal for every rank, so collective training cannot hang on an uneven last batch:
    ``drop_remainder`` leaves the epoch's last ``count % world_size`` rows out; otherwise the
    order wraps and a few rows are read twice."""
    return count // world_size if drop_remainder else math.ceil(count / world_size)


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` of block ``block``, the rank's rows ``offset`` on, visited in
    ``order()`` (computed when needed: the plan stays a few numbers a block)."""

    block: int
    start: int
    stop: int
    offset: int  # the position of the piece's first row in the rank's epoch sequence
    seed: int
    epoch: int
    shuffle: bool

    def __len__(self) -> int:
        return self.stop - self.start

    def order(self) -> np.ndarray:
        """The in-piece positions in visit order."""
        if not self.shuffle:
            return np.arange(len(self))
        rng = np.random.default_rng([self.seed, self.epoch, self.block, self.start, _SALT_PIECE])
        return rng.permutation(len(self))


@dataclass(frozen=True)
class Order:
    """One epoch's order of a view's ``count`` rows, split between ``world_size`` ranks."""

    count: int
    block: int
    seed: int = 0
    shuffle: bool = True
    drop_remainder: bool = True
    world_size: int = 1

    @property
    def per_rank(self) -> int:
        return rows_per_rank(self.count, self.world_size, self.drop_remainder)

    def _blocks(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids in visit order, each visited block's start in the epoch sequence)."""
        n_blocks = math.ceil(self.count / self.block)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, _SALT_BLOCKS]).permutation(n_blocks)
        else:
            order = np.arange(n_blocks)
        sizes = np.minimum(self.block, self.count - order * self.block)
        return order, np.concatenate([[0], np.cumsum(sizes)])

    def pieces(self, epoch: int, rank: int, start: int = 0) -> Iterator[Piece]:
        """The pieces of ``rank``'s rows this epoch in visit order, from the one holding
        position ``start`` on (found by bisection: a resume costs no walk of the epoch)."""
        per_rank = self.per_rank
        if per_rank == 0 or start >= per_rank:
            return
        order, starts = self._blocks(epoch)
        # per_rank <= count: the order wraps around to its start at most once
        lo = rank * per_rank % self.count
        spans = [(lo, min(lo + per_rank, self.count)), (0, max(lo + per_rank - self.count, 0))]
        offset = 0
        for span_lo, span_hi in spans:
            if span_hi <= span_lo:
                continue
            if offset + span_hi - span_lo <= start:
                offset += span_hi - span_lo
                continue
            at = span_lo + max(start - offset, 0)
            i = int(np.searchsorted(starts, at, side="right")) - 1
            while i < len(order) and starts[i] < span_hi:
                b_lo, b_hi = int(starts[i]), int(starts[i + 1])
                s, e = max(span_lo, b_lo) - b_lo, min(span_hi, b_hi) - b_lo
                if e > s:
                    first = offset + b_lo + s - span_lo
                    yield Piece(int(order[i]), s, e, first, self.seed, epoch, self.shuffle)
                i += 1
            offset += span_hi - span_lo

    def indexes(self, epoch: int, rank: int) -> np.ndarray:
        """The view's key indexes of ``rank``'s rows this epoch, in visit order."""
        parts = [p.block * self.block + p.start + p.order() for p in self.pieces(epoch, rank)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def locate(self, index: int, epoch: int) -> list[tuple[int, int]]:
        """Every (rank, position) the row at ``index`` is read at in ``epoch`` (none when
        dropped as remainder; two when the order wraps)."""
        block, offset = divmod(index, self.block)
        found = []
        for rank in range(self.world_size):
            for piece in self.pieces(epoch, rank):
                if piece.block == block and piece.start <= offset < piece.stop:
                    at = int(np.flatnonzero(piece.order() == offset - piece.start)[0])
                    found.append((rank, piece.offset + at))
        return found


@dataclass(frozen=True)
class StepRule:
    """How a rank's rows become optimizer steps (the loop and lineage follow it): ``rows``
    consecutive positions make a step, ``micro`` of them a micro-batch; steps are numbered
    from 1 across epochs. A skipped row leaves a hole: no step depends on which were skipped."""

    order: Order
    rows: int
    micro: int

    @property
    def per_epoch(self) -> int:
        return -(-self.order.per_rank // self.rows)

    def epoch_of(self, step: int) -> int:
        """The epoch step ``step`` (>= 1) trains in."""
        return (step - 1) // max(self.per_epoch, 1)

    def after(self, step: int) -> tuple[int, int]:
        """(epoch, first position) where a run that reached ``step`` continues."""
        epoch, index = divmod(step, max(self.per_epoch, 1))
        return epoch, index * self.rows

    def steps(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The step that trains each position of ``epoch``."""
        return epoch * self.per_epoch + positions // self.rows + 1
