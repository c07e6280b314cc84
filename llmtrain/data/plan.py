"""The epoch plan: which rows a (rank, worker) reads, and in what order.

The order is a pure function of (seed, epoch, row count, block size, world size): blocks of
``block_size`` consecutive keys are permuted, each rank takes a contiguous run of that
sequence, and rows are shuffled inside each piece of a block. No state is carried between
epochs, so resuming needs only {epoch, rows consumed} and skips in O(1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_SALT_BLOCKS = 0x6C74_0001
_SALT_PIECE = 0x6C74_0002


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` (key order) of block ``block``, visited in ``order()``.

    The visit order is computed when the piece is fetched, not kept: an epoch's plan stays a
    few numbers per window however many rows it covers.
    """

    block: int
    start: int
    stop: int
    seed: int
    epoch: int
    shuffle: bool

    def __len__(self) -> int:
        return self.stop - self.start

    def order(self) -> list[int]:
        """A permutation of ``range(len(self))``: the in-piece positions in visit order."""
        n = self.stop - self.start
        if not self.shuffle:
            return list(range(n))
        rng = np.random.default_rng([self.seed, self.epoch, self.block, self.start, _SALT_PIECE])
        return rng.permutation(n).tolist()


def rows_per_rank(count: int, world_size: int, drop_remainder: bool) -> int:
    """Equal for every rank, so collective training cannot hang on an uneven last batch.

    ``drop_remainder``: the last ``count % world_size`` rows of the epoch's order are left
    out (different rows each epoch when shuffling); otherwise the order wraps around and the
    first ``world_size - count % world_size`` rows are read twice.
    """
    return count // world_size if drop_remainder else math.ceil(count / world_size)


def rank_pieces(
    count: int,
    block_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    world_size: int,
    rank: int,
    drop_remainder: bool = True,
) -> list[Piece]:
    """The pieces making up ``rank``'s rows this epoch, in visit order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    per_rank = rows_per_rank(count, world_size, drop_remainder)
    if per_rank == 0:
        return []
    n_blocks = math.ceil(count / block_size)
    if shuffle:
        order = np.random.default_rng([seed, epoch, _SALT_BLOCKS]).permutation(n_blocks)
    else:
        order = np.arange(n_blocks)
    sizes = np.minimum(block_size, count - order * block_size)
    starts = np.concatenate([[0], np.cumsum(sizes)])  # global start of each visited block

    # per_rank <= count: padding wraps around to the start of the epoch's order at most once
    lo = rank * per_rank % count
    spans = [(lo, min(lo + per_rank, count)), (0, max(lo + per_rank - count, 0))]
    pieces: list[Piece] = []
    for span_lo, span_hi in spans:
        first = int(np.searchsorted(starts, span_lo, side="right")) - 1
        for i in range(first, n_blocks):
            b_lo, b_hi = int(starts[i]), int(starts[i + 1])
            if b_lo >= span_hi:
                break
            s, e = max(span_lo, b_lo) - b_lo, min(span_hi, b_hi) - b_lo
            if e > s:
                pieces.append(Piece(int(order[i]), s, e, seed, epoch, shuffle))
    return pieces


@dataclass(frozen=True)
class WorkerSlice:
    """What one worker reads of a piece: visit-order indices ``picks`` (into the piece's
    order) from ``first`` on, each at ``offset + index`` in the rank's sequence."""

    piece: Piece
    offset: int  # index of the piece's first row in the rank's sequence
    first: int  # the first visit-order index this pass reads (resume may start mid-piece)
    start: int  # the rank-sequence index the pass starts at
    worker: int
    num_workers: int
    chunk: int

    @property
    def picks(self) -> Sequence[int]:
        n = len(self.piece)
        if self.num_workers == 1:
            return range(self.first, n)
        return [
            i
            for i in range(self.first, n)
            if ((self.offset + i - self.start) // self.chunk) % self.num_workers == self.worker
        ]


def worker_slices(
    pieces: list[Piece], *, start: int, worker: int, num_workers: int, chunk: int
) -> list[WorkerSlice]:
    """Split the rank's sequence from ``start`` on between workers.

    Worker ``k`` takes chunks ``k, k + n, k + 2n, ...`` of ``chunk`` rows (chunk = the
    loader's batch size), so a DataLoader that takes one batch from each worker in turn
    yields exactly the rank's sequence, whatever the number of workers.
    """
    out: list[WorkerSlice] = []
    offset = 0
    for piece in pieces:
        n = len(piece)
        lo = max(start, offset)
        if lo < offset + n:
            ws = WorkerSlice(piece, offset, lo - offset, start, worker, num_workers, chunk)
            if num_workers == 1 or ws.picks:
                out.append(ws)
        offset += n
    return out
