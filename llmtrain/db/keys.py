"""Row keys, named, compared, checked and digested (split, lineage, forget) to a uint64 of value and
type: splitmix64 for ints, XXH3 of the bytes (str, UUID, bytes) or key_repr, seeded per type."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import xxhash

from llmtrain.errors import QueryError

Key = Any
DIGEST = "splitmix64-xxh3-1"  # the digest's rule, recorded with every split it decided
_XXH3 = xxhash.xxh3_64_intdigest
#: the bytes of a key of each type XXH3 digests, and its seed (any other type: key_repr's, 1)
_AS_BYTES: dict[type, tuple[Callable[[Any], bytes], int]] = {
    str: (operator.methodcaller("encode", "utf-8", "surrogatepass"), 2),
    uuid.UUID: (operator.attrgetter("bytes"), 3),
    bytes: (bytes, 4),
}
_NEVER_NAN = {int, str, bytes, uuid.UUID}


def key_repr(key: Key) -> str:
    """A key as text that keeps its type (``int:5``; a string stays itself)."""
    return key if isinstance(key, str) else f"{type(key).__name__}:{key}"


def same_key(a: Key, b: Key) -> bool:
    """Equal keys of one type (MongoDB keeps ``1`` and ``True`` apart, Python does not)."""
    return type(a) is type(b) and a == b


def _splitmix(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _bytes(key: Key) -> tuple[bytes, int]:
    if type(key) in _AS_BYTES:
        to_bytes, seed = _AS_BYTES[type(key)]
        return to_bytes(key), seed
    return key_repr(key).encode("utf-8", "surrogatepass"), 1


def key_digests(keys: Sequence[Key] | np.ndarray) -> np.ndarray:
    if isinstance(keys, np.ndarray) and keys.dtype == np.int64:
        return _splitmix(keys)
    kinds = set(map(type, keys))
    if len(kinds) == 1 and (kind := kinds.pop()) in _AS_BYTES:  # one C-level pass per step
        to_bytes, seed = _AS_BYTES[kind]
        digests = map(_XXH3, map(to_bytes, keys), repeat(seed))
        return np.fromiter(digests, dtype=np.uint64, count=len(keys))
    ints = [i for i, k in enumerate(keys) if type(k) is int and -(2**63) <= k < 2**63]
    if len(ints) == len(keys):
        return _splitmix(np.array(keys, dtype=np.int64))
    out = np.empty(len(keys), dtype=np.uint64)
    out[ints] = _splitmix(np.array([keys[i] for i in ints], dtype=np.int64))
    rest = sorted(set(range(len(keys))) - set(ints))
    out[rest] = np.fromiter(
        (_XXH3(*_bytes(keys[i])) for i in rest), dtype=np.uint64, count=len(rest)
    )
    return out


def in_sorted(sorted_digests: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """Which of ``digests`` are in ``sorted_digests``: one search (``np.isin`` sorts both)."""
    if not len(sorted_digests) or not len(digests):
        return np.zeros(len(digests), dtype=bool)
    order = np.argsort(digests)  # sorted needles search a large array 2-3x faster (locality)
    wanted = digests[order]
    at = np.searchsorted(sorted_digests, wanted).clip(max=len(sorted_digests) - 1)
    found = np.empty(len(digests), dtype=bool)
    found[order] = sorted_digests[at] == wanted
    return found


def held_mask(digests: np.ndarray, fraction: float) -> np.ndarray:
    """Which keys the held-out split takes: a digest below ``fraction`` of the range."""
    return digests < np.uint64(min(int(max(fraction, 0) * 2**64), 2**64 - 1))


def held_out(key: Key, fraction: float) -> bool:
    """Whether one row belongs to the held-out split (the split's rule for one key)."""
    return bool(held_mask(key_digests([key]), fraction)[0])


@dataclass(frozen=True)
class KeyPage:
    """One statement's keys in key order (integers: an int64 array) and, if asked, versions."""

    keys: Any
    versions: list[Any] | None


def check_keys(keys: Any, before: Any, key_name: str, source: str) -> None:
    """Refuse a NULL or NaN key (equal to itself to PostgreSQL, not Python), or one equal to the
    one before (``before``: the last page's last): paging would read rows twice or skip them."""
    if isinstance(keys, np.ndarray):  # integers, sorted by value: one C pass
        bad = np.flatnonzero(np.diff(keys) <= 0)
        if len(bad) or (len(keys) and type(before) is int and keys[0] <= before):
            dup = int(keys[bad[0] + 1]) if len(bad) else int(keys[0])
            raise _not_unique(key_name, source, dup)
        return
    kinds = set(map(type, keys))
    if type(None) in kinds:
        raise _not_unique(key_name, source, None)
    if kinds - _NEVER_NAN and any(map(operator.ne, keys, keys)):  # only NaN differs from itself
        raise _not_unique(key_name, source, next(k for k in keys if k != k))
    prev = [before, *keys[:-1]]
    if kinds == {uuid.UUID}:  # compared by their ints: UUID.__eq__ is Python code
        ints = list(map(operator.attrgetter("int"), keys))
        prev, keys = [getattr(before, "int", None), *ints[:-1]], ints
    if any(map(operator.eq, prev, keys)):  # in C; then exactly (1 == True, but not in Mongo)
        for a, b in zip(prev, keys):
            if same_key(a, b):
                raise _not_unique(key_name, source, uuid.UUID(int=b) if kinds == {uuid.UUID} else b)


def _not_unique(key_name: str, source: str, key: Key) -> QueryError:
    what = "NULL" if key is None else "NaN" if key != key else f"the key {key!r} more than once"
    return QueryError(
        f"{source}: key column {key_name!r} holds {what}, so rows would "
        "be read twice or skipped; pass key= naming a unique, non-null column, or use "
        "llmtrain.sql(select, key=...) with a unique expression"
    )
