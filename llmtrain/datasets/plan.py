"""The epoch plan: which rows a (rank, worker) reads, and in what order.

The order is a pure function of (seed, epoch, row count, block size, world size): blocks of
``block_size`` consecutive keys are permuted, each rank takes a contiguous run of that
sequence, and rows are shuffled inside each piece of a block. No state is carried between
epochs, so resuming needs only {epoch, rows consumed} and skips in O(1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_SALT_BLOCKS = 0x6C74_0001
_SALT_PIECE = 0x6C74_0002


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` (key order) of block ``block``, visited in ``order``."""

    block: int
    start: int
    stop: int
    order: tuple[int, ...]  # a permutation of range(stop - start): the visit order

    def __len__(self) -> int:
        return self.stop - self.start


def rows_per_rank(count: int, world_size: int, drop_remainder: bool) -> int:
    """Equal for every rank, so collective training cannot hang on an uneven last batch.

    ``drop_remainder``: the last ``count % world_size`` rows of the epoch's order are left
    out (different rows each epoch when shuffling); otherwise the order wraps around and the
    first ``world_size - count % world_size`` rows are read twice.
    """
    if count == 0:
        return 0
    return count // world_size if drop_remainder else math.ceil(count / world_size)


def block_order(n_blocks: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n_blocks)
    return np.random.default_rng([seed, epoch, _SALT_BLOCKS]).permutation(n_blocks)


def rank_pieces(count: int, block_size: int, *, seed: int, epoch: int, shuffle: bool,
                world_size: int, rank: int, drop_remainder: bool = True) -> list[Piece]:
    """The pieces making up ``rank``'s rows this epoch, in visit order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    per_rank = rows_per_rank(count, world_size, drop_remainder)
    if per_rank == 0:
        return []
    n_blocks = math.ceil(count / block_size)
    order = block_order(n_blocks, seed, epoch, shuffle)
    sizes = np.minimum(block_size, count - order * block_size)
    starts = np.concatenate([[0], np.cumsum(sizes)])  # global start of each visited block

    lo, hi = rank * per_rank, (rank + 1) * per_rank
    spans = []  # padding wraps around to the start of the epoch's order
    pos = lo
    while pos < hi:
        span_lo = pos % count
        take = min(hi - pos, count - span_lo)
        spans.append((span_lo, span_lo + take))
        pos += take

    pieces: list[Piece] = []
    for span_lo, span_hi in spans:
        first = int(np.searchsorted(starts, span_lo, side="right")) - 1
        for i in range(first, n_blocks):
            b_lo, b_hi = int(starts[i]), int(starts[i + 1])
            if b_lo >= span_hi:
                break
            s, e = max(span_lo, b_lo) - b_lo, min(span_hi, b_hi) - b_lo
            if e > s:
                pieces.append(_piece(int(order[i]), s, e, seed, epoch, shuffle))
    return pieces


def _piece(block: int, start: int, stop: int, seed: int, epoch: int, shuffle: bool) -> Piece:
    n = stop - start
    if shuffle:
        rng = np.random.default_rng([seed, epoch, block, start, _SALT_PIECE])
        order = tuple(int(i) for i in rng.permutation(n))
    else:
        order = tuple(range(n))
    return Piece(block, start, stop, order)


@dataclass(frozen=True)
class WorkerSlice:
    """What one worker reads of a piece: in-piece positions (key order), in visit order,
    each with its index in the rank's sequence."""

    piece: Piece
    offset: int  # index of the piece's first row in the rank's sequence
    picks: tuple[int, ...]  # visit-order indices into piece.order this worker takes

    @property
    def whole(self) -> bool:
        return len(self.picks) == len(self.piece)


def worker_slices(pieces: list[Piece], *, start: int, worker: int, num_workers: int,
                  chunk: int) -> list[WorkerSlice]:
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
            picks = tuple(i - offset for i in range(lo, offset + n)
                          if ((i - start) // chunk) % num_workers == worker)
            if picks:
                out.append(WorkerSlice(piece, offset, picks))
        offset += n
    return out
