"""One scan of a selection per run: its size, its fingerprint, and the held-out split.

The held-out rows are chosen by a hash of each key, so training rows and held-out rows are
two views of the same keyed order, each with its own count and window boundaries. A run
scans once (rank 0) and hands the result to every dataset and rank that reads the
selection. A later issue replaces the scan by a stored snapshot of keys: keep it behind
:func:`scan_selection`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from llmtrain.backends.base import DataBackend, Key, KeyScan
from llmtrain.errors import QueryError
from llmtrain.queries import Query

Split = Literal["all", "train", "held_out"]
_KEY_PAGE = 50_000  # keys per statement when the split needs every key on the client


def key_repr(key: Key) -> str:
    return key if isinstance(key, str) else f"{type(key).__name__}:{key}"


def held_out(key: Key, fraction: float) -> bool:
    """Whether a row belongs to the held-out split: a hash of its key, stable across runs."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(key_repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def data_fingerprint(scan: KeyScan) -> str:
    """Changes when rows are added, removed or re-keyed anywhere in the selection."""
    payload = json.dumps(
        [
            scan.count,
            scan.block_size,
            [key_repr(k) for k in scan.boundaries],
            key_repr(scan.last_key),
        ]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def same_key(a: Key, b: Key) -> bool:
    """Equal keys of one type (MongoDB keeps ``1`` and ``True`` apart, Python does not)."""
    return type(a) is type(b) and a == b


def _not_unique(backend: DataBackend, query: Query, key: Key) -> QueryError:
    what = "NULL" if key is None else f"the key {key!r} more than once"
    return QueryError(
        f"{query.source}: key column {backend.key_name(query)!r} holds {what}, so rows would "
        "be read twice or skipped; pass key= naming a unique, non-null column, or use "
        "llmtrain.sql(select, key=...) with a unique expression"
    )


@dataclass(frozen=True)
class SelectionScan:
    """The whole selection's :class:`KeyScan` and, with ``eval_fraction``, one per view."""

    query: str  # the query's fingerprint: a scan is only reused for the query it describes
    whole: KeyScan
    eval_fraction: float = 0.0
    train: KeyScan | None = None  # None: no split, the view is the whole selection
    held: KeyScan | None = None
    statements: int = 1

    @property
    def fingerprint(self) -> str:
        return data_fingerprint(self.whole)

    def view(self, split: Split) -> KeyScan:
        """The rows a ``split`` reads: all of them, the training rows or the held-out rows."""
        if split == "all" or self.eval_fraction <= 0:
            return (
                self.whole if split != "held_out" else KeyScan(0, self.whole.block_size, [], None)
            )
        return self.train if split == "train" else self.held  # type: ignore[return-value]

    def fits(self, query: Query, block_size: int, eval_fraction: float) -> bool:
        """Whether this scan describes ``query`` read in ``block_size`` windows."""
        return (
            self.query == query.fingerprint()
            and self.whole.block_size == block_size
            and (self.eval_fraction == eval_fraction or eval_fraction <= 0)
        )


@dataclass
class _Blocks:
    """Counts keys in order and notes every ``block_size``-th one."""

    block_size: int
    count: int = 0
    boundaries: list[Key] = field(default_factory=list)
    last: Key | None = None

    def add(self, key: Key) -> None:
        if self.count % self.block_size == 0:
            self.boundaries.append(key)
        self.count += 1
        self.last = key

    def scan(self) -> KeyScan:
        return KeyScan(self.count, self.block_size, self.boundaries, self.last)


def scan_selection(
    backend: DataBackend, query: Query, block_size: int, eval_fraction: float = 0.0
) -> SelectionScan:
    """Count the selection and note every ``block_size``-th key of it and of each view.

    Without a split the backend does it in one statement. A split needs every key hashed
    on the client: keys only, in keyset pages (about a second per million rows). Either way
    a key that is not unique is refused: paging on it would read rows twice or skip them.
    """
    if eval_fraction <= 0:
        return SelectionScan(query.fingerprint(), backend.scan_keys(query, block_size))
    whole, train, held = _Blocks(block_size), _Blocks(block_size), _Blocks(block_size)
    lower: Any = None
    statements = 0
    while True:
        # each page after the first starts *at* the last key seen, so a key repeated across
        # the page boundary shows up as a repeat too; that one overlapping key is dropped
        page = backend.fetch_rows(query, (), lower, _KEY_PAGE)
        statements += 1
        keys = [k for k, _ in page]
        if lower is not None and keys and same_key(keys[0], lower):
            keys = keys[1:]
        for key in keys:
            if key is None or (whole.count and same_key(key, whole.last)):
                raise _not_unique(backend, query, key)
            whole.add(key)
            (held if held_out(key, eval_fraction) else train).add(key)
        if len(page) < _KEY_PAGE:
            break
        lower = page[-1][0]
    return SelectionScan(
        query.fingerprint(), whole.scan(), eval_fraction, train.scan(), held.scan(), statements
    )
