"""The epoch order, a pure function of (seed, epoch, count, block, world size): blocks of keys
permuted, each rank a contiguous run, rows shuffled inside each piece; and the rule from rows to
steps. Stateless between epochs: resume and lineage are arithmetic (NumPy over blocks)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

_SALT_BLOCKS = 0x6C74_0001
_SALT_PIECE = 0x6C74_0002
_SALT_MIX = 0x6C74_0003


def rows_per_rank(count: int, world_size: int, drop_remainder: bool) -> int:
    """Equal for every rank, so collectives cannot hang on an uneven last batch: the epoch's last
    ``count % world_size`` rows are dropped (``drop_remainder``), or the order wraps to fill."""
    return count // world_size if drop_remainder else math.ceil(count / world_size)


class Piece(NamedTuple):
    """Rows ``start:stop`` of ``block`` (visit order computed on demand: a few numbers a block)."""

    block: int
    start: int
    stop: int
    offset: int  # the position of its first row in the rank's epoch sequence


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
        order = np.arange(n_blocks)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, _SALT_BLOCKS]).permutation(n_blocks)
        sizes = np.minimum(self.block, self.count - order * self.block)
        return order, np.concatenate([[0], np.cumsum(sizes)])

    def visit(self, epoch: int, piece: Piece) -> np.ndarray:
        size = piece.stop - piece.start
        if not self.shuffle:
            return np.arange(size)
        seed = [self.seed, epoch, piece.block, piece.start, _SALT_PIECE]
        return np.random.default_rng(seed).permutation(size)

    def pieces(self, epoch: int, rank: int, start: int = 0) -> Iterator[Piece]:
        """``rank``'s pieces in visit order from the one holding ``start`` (bisected: no walk)."""
        if start >= self.per_rank:  # also when no row is left for a rank
            return
        order, starts = self._blocks(epoch)
        for span_lo, span_hi, offset in self._spans(rank):
            if span_hi > span_lo and offset + span_hi - span_lo > start:
                at = span_lo + max(start - offset, 0)
                i = int(np.searchsorted(starts, at, side="right")) - 1
                while i < len(order) and starts[i] < span_hi:
                    b_lo, b_hi = int(starts[i]), int(starts[i + 1])
                    s, e = max(span_lo, b_lo) - b_lo, min(span_hi, b_hi) - b_lo
                    if e > s:
                        yield Piece(int(order[i]), s, e, offset + b_lo + s - span_lo)
                    i += 1

    def _spans(self, rank: int) -> list[tuple[int, int, int]]:
        """(lo, hi, positions before it) of each span of the epoch sequence ``rank`` reads: from
        its start, then wrapped to the beginning (per_rank <= count: at most once; may be empty)."""
        lo, per_rank = rank * self.per_rank % self.count, self.per_rank
        hi = min(lo + per_rank, self.count)
        return [(lo, hi, 0), (0, max(lo + per_rank - self.count, 0), hi - lo)]

    def spans(self, epoch: int, rank: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """(first position, view indexes in visit order) of each piece from ``start``: the reads."""
        for p in self.pieces(epoch, rank, start):
            yield p.offset, p.block * self.block + p.start + self.visit(epoch, p)

    def indexes(self, epoch: int, rank: int) -> np.ndarray:
        """The view's key indexes of ``rank``'s rows this epoch, in visit order."""
        parts = [indexes for _, indexes in self.spans(epoch, rank)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def locate(self, index: int, epoch: int) -> list[tuple[int, int]]:
        """Each (rank, position) reading ``index`` in ``epoch``: none if dropped, two if wrapped.
        The block's place in the epoch from the inverse of its permutation (kept per epoch), then
        the rank spans over it: no walk over the blocks (10M rows: ~20 us, not ~10 ms, a key)."""
        block, offset = divmod(index, self.block)
        _, starts, place = _placed(self, epoch)
        b_lo, b_hi = int(starts[place[block]]), int(starts[place[block] + 1])
        found, per_rank = [], self.per_rank
        for rank in range(self.world_size if per_rank else 0):
            for span_lo, span_hi, before in self._spans(rank):
                s, e = max(span_lo, b_lo) - b_lo, min(span_hi, b_hi) - b_lo
                if s <= offset < e:
                    visit = self.visit(epoch, Piece(block, s, e, 0))
                    at = int(np.flatnonzero(visit == offset - s)[0])
                    found.append((rank, before + b_lo + s - span_lo + at))
        return found


@dataclass(frozen=True)
class MixOrder(Order):
    """A mixture's epoch: ``count`` positions, each source's ``weights`` share (largest remainder)
    spread evenly from a seeded phase, continuing its passes (each an :class:`Order`), so no row
    repeats before its source was seen. Indexes run over the sources' keys end to end."""

    counts: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def shares(self) -> np.ndarray:
        """Each source's rows an epoch (a source with no rows gets none)."""
        weights = np.asarray(self.weights) * (np.asarray(self.counts) > 0)
        exact = self.count * weights / weights.sum()
        shares = np.floor(exact).astype(np.int64)
        shares[np.argsort(shares - exact, kind="stable")[: self.count - shares.sum()]] += 1
        return shares

    def epoch(self, epoch: int) -> np.ndarray:
        """Every position's key index this epoch (all ranks): computed once per epoch."""
        return _mixed_epoch(self, epoch)

    def spans(self, epoch: int, rank: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """As :meth:`Order.spans`: ``rank``'s rows from ``start``, ``block`` at a time."""
        mine = self.indexes(epoch, rank)
        for lo in range(start, len(mine), self.block):
            yield lo, mine[lo : lo + self.block]

    def indexes(self, epoch: int, rank: int) -> np.ndarray:
        positions = (rank * self.per_rank + np.arange(self.per_rank)) % max(self.count, 1)
        return self.epoch(epoch)[positions]

    def locate(self, index: int, epoch: int) -> list[tuple[int, int]]:
        return [
            (rank, int(at))
            for rank in range(self.world_size)
            for at in np.flatnonzero(self.indexes(epoch, rank) == index)
        ]


@functools.lru_cache(maxsize=4)
def _placed(order: Order, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(blocks in visit order, their starts, each block's place in that order) of an epoch."""
    blocks, starts = order._blocks(epoch)
    place = np.empty(len(blocks), dtype=np.int64)
    place[blocks] = np.arange(len(blocks))
    return blocks, starts, place


@functools.lru_cache(maxsize=4)
def _mixed_epoch(order: MixOrder, epoch: int) -> np.ndarray:
    shares, counts = order.shares(), np.asarray(order.counts)
    phase = np.random.default_rng([order.seed, epoch, _SALT_MIX]).random(len(shares))
    times = np.concatenate([(np.arange(n) + p) / max(n, 1) for n, p in zip(shares, phase)])
    source = np.repeat(np.arange(len(shares)), shares)[np.argsort(times, kind="stable")]
    out = np.empty(order.count, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for s in np.flatnonzero(shares).tolist():
        # this epoch's rows of source s continue its stream: passes of its own order
        stream = epoch * int(shares[s]) + np.arange(shares[s])
        passes, at = np.divmod(stream, counts[s])
        seed = int(np.random.default_rng([order.seed, s, _SALT_MIX]).integers(2**62))
        own = Order(int(counts[s]), order.block, seed, order.shuffle)
        where = np.flatnonzero(source == s)
        for n in np.unique(passes).tolist():
            hit = passes == n
            out[where[hit]] = starts[s] + own.indexes(n, 0)[at[hit]]
    return out


@dataclass(frozen=True)
class StepRule:
    """A rank's rows as optimizer steps, numbered from 1 across epochs: ``rows`` consecutive
    positions a step, ``micro`` a micro-batch; a skipped row leaves a hole, moving no step."""

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
        return epoch * self.per_epoch + positions // self.rows + 1
