"""A run's selection keys, read once into content-addressed chunks that every epoch, rank and
resume reads instead of the table. A chunk is a tag byte and zlib data (``i`` int64 deltas, ``u``
UUIDs, ``s`` JSON strings, ``t`` typed JSON); never pickle: keys keep the database's types."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import operator
import threading
import uuid
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import numpy as np
from bson import ObjectId

from llmtrain.db.keys import DIGEST, Key, held_mask, key_digests
from llmtrain.db.queries import TURNS, Conversations, Mix, Query
from llmtrain.errors import ConfigError, QueryError

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database

Split = Literal["all", "train", "held_out"]
CODEC = "keys-v1"
CHUNK_SIZE = 16_384  # keys a chunk: a window of cache_size rows reads one chunk or two
_KEY_PAGE = 250_000  # keys a statement while taking the snapshot (measured: 1.1x the raw read)
_CACHED_CHUNKS = 4  # decoded chunks kept per process (a window spans at most two)


_PLAIN = {type(None): "n", bool: "?", int: "i", str: "s"}  # tags of the types JSON keeps as is
# each other type a typed chunk keeps, with its tag and how it becomes JSON and back
_CODECS: dict[type, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    float: ("f", float.hex, float.fromhex),
    uuid.UUID: ("u", operator.attrgetter("hex"), uuid.UUID),
    bytes: ("x", bytes.hex, bytes.fromhex),
    dt.datetime: ("dt", dt.datetime.isoformat, dt.datetime.fromisoformat),
    dt.date: ("d", dt.date.isoformat, dt.date.fromisoformat),
    Decimal: ("D", str, Decimal),
    ObjectId: ("o", str, ObjectId),
}
_DECODERS = {tag: decode for tag, _, decode in _CODECS.values()}


def typed(value: Any) -> list[Any]:
    """One value as ``[tag, json value]``: its type survives the round trip."""
    t = type(value)
    if t is dict:  # a MongoDB _id may be a document
        return ["m", [[k, typed(v)] for k, v in value.items()]]
    if t in _PLAIN:
        return [_PLAIN[t], value]
    if t not in _CODECS:
        raise QueryError(
            f"a key or version of type {t.__module__}.{t.__name__} ({value!r:.60}) cannot "
            "be kept in a run's snapshot; use a column of a plain type (int, str, uuid, "
            "datetime, ...)"
        )
    tag, encode, _ = _CODECS[t]
    return [tag, encode(value)]


def untyped(item: list[Any]) -> Any:
    tag, value = item
    if tag == "m":
        return {k: untyped(v) for k, v in value}
    return value if tag in _PLAIN.values() else _DECODERS[tag](value)


def encode_chunk(values: Sequence[Any] | np.ndarray) -> bytes:
    """The most compact of the chunk forms that holds exactly these values."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        with np.errstate(over="ignore"):
            deltas = np.diff(values, prepend=np.int64(0))
        return b"i" + zlib.compress(deltas.astype("<i8").tobytes(), 1)
    types = {type(v) for v in values}
    if types == {int} and all(-(2**63) <= v < 2**63 for v in values):
        return encode_chunk(np.asarray(values, dtype=np.int64))
    if types == {uuid.UUID}:
        tag, payload = b"u", b"".join(v.bytes for v in values)
    elif types == {str}:
        tag, payload = b"s", json.dumps(list(values), ensure_ascii=False).encode()
    else:
        tag, payload = b"t", json.dumps([typed(v) for v in values]).encode()
    return tag + zlib.compress(payload, 1)  # level 1: 5x faster than 6, a few % larger


def decode_chunk(data: bytes) -> np.ndarray:
    """A chunk's values: an int64 array for integer keys, else an object array."""
    tag, payload = data[:1], zlib.decompress(data[1:])
    if tag == b"i":
        with np.errstate(over="ignore"):  # deltas wrap like the values did
            return np.cumsum(np.frombuffer(payload, dtype="<i8"))
    if tag == b"u":
        values = [uuid.UUID(bytes=payload[i : i + 16]) for i in range(0, len(payload), 16)]
    elif tag == b"s":
        values = list(json.loads(payload))
    elif tag == b"t":
        values = [untyped(item) for item in json.loads(payload)]
    else:
        raise ConfigError(f"not a {CODEC} key chunk (tag {tag!r})")
    return np.array(values, dtype=object)


class Blobs(Protocol):
    """Bytes in for an id, and back: the artifact store, or :class:`MemoryStore`."""

    def put_bytes(self, data: bytes) -> str: ...

    def get_bytes(self, artifact_id: str) -> bytes: ...


class MemoryStore:
    """Chunks kept in this process: a dataset's own snapshot when no run gave it one."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put_bytes(self, data: bytes) -> str:
        artifact_id = f"sha256:{hashlib.sha256(data).hexdigest()}"
        self.blobs[artifact_id] = data
        return artifact_id

    def get_bytes(self, artifact_id: str) -> bytes:
        return self.blobs[artifact_id]


_decoded: OrderedDict[str, np.ndarray] = OrderedDict()
_decoded_lock = threading.Lock()


def _chunk(store: Blobs, chunk_id: str) -> np.ndarray:
    """A decoded chunk; the last few are cached (ids are content hashes, so always valid)."""
    with _decoded_lock:
        if chunk_id in _decoded:
            _decoded.move_to_end(chunk_id)
            return _decoded[chunk_id]
    values = decode_chunk(store.get_bytes(chunk_id))
    with _decoded_lock:
        _decoded[chunk_id] = values
        while len(_decoded) > _CACHED_CHUNKS:
            _decoded.popitem(last=False)
    return values


@dataclass(frozen=True)
class KeySnapshot:
    """One view's ``count`` keys in key order, ``chunk_size`` a chunk (versions chunked alike)."""

    count: int
    chunk_size: int
    chunks: tuple[str, ...]
    codec: str = CODEC
    fingerprint: str = ""
    versions: tuple[str, ...] | None = None

    @staticmethod
    def digest(count: int, chunks: Sequence[str], versions: Sequence[str] | None) -> str:
        """Changes when any key (or version) is added, removed or changed."""
        payload = json.dumps([count, list(chunks), list(versions or [])])
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def to_record(self) -> dict[str, Any]:
        versions = None if self.versions is None else list(self.versions)
        return {**asdict(self), "chunks": list(self.chunks), "versions": versions}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> KeySnapshot:
        if not isinstance(data, dict) or data.get("codec") != CODEC:
            raise ConfigError(f"not a {CODEC} key snapshot: {str(data)[:200]}")
        snap = cls(
            int(data["count"]),
            int(data["chunk_size"]),
            tuple(data["chunks"]),
            CODEC,
            str(data["fingerprint"]),
            None if data.get("versions") is None else tuple(data["versions"]),
        )
        if snap.fingerprint != cls.digest(snap.count, snap.chunks, snap.versions):
            raise ConfigError(f"key snapshot {snap.fingerprint}: its chunks do not match it")
        return snap

    def keys(self, store: Blobs, start: int, stop: int) -> list[Key]:
        return self.keys_at(store, np.arange(max(start, 0), min(stop, self.count)))

    def keys_at(self, store: Blobs, indexes: np.ndarray) -> list[Key]:
        """The keys at ``indexes`` (any order), reading each chunk they fall in once."""
        return self._at(store, self.chunks, indexes)

    def versions_at(self, store: Blobs, indexes: np.ndarray) -> list[Any]:
        if self.versions is None:
            raise ConfigError("this snapshot was taken without a version column")
        return self._at(store, self.versions, indexes)

    def iter_keys(self, store: Blobs) -> Iterator[Key]:
        """Every key in order, one chunk in memory at a time."""
        for chunk_id in self.chunks:
            yield from decode_chunk(store.get_bytes(chunk_id)).tolist()

    def _at(self, store: Blobs, chunks: Sequence[str], indexes: np.ndarray) -> list[Any]:
        chunk_of = indexes // self.chunk_size
        firsts = np.unique(chunk_of)
        if len(firsts) == 1:  # the usual case: a step's rows are a piece of one block
            base = int(firsts[0]) * self.chunk_size
            return list(_chunk(store, chunks[int(firsts[0])])[indexes - base].tolist())
        out = np.empty(len(indexes), dtype=object)
        for c in firsts.tolist():
            mine = chunk_of == c
            out[mine] = _chunk(store, chunks[c])[indexes[mine] - c * self.chunk_size]
        return out.tolist()

    def digests(self, store: Blobs) -> Iterator[np.ndarray]:
        """Each chunk's key digests (:func:`~llmtrain.db.keys.key_digests`), in order."""
        for chunk_id in self.chunks:
            values = decode_chunk(store.get_bytes(chunk_id))
            yield key_digests(values if values.dtype == np.int64 else values.tolist())


def tagged(part: int, key: Key) -> dict[str, Any]:
    """A mixture's key (the same key in two sources is two rows); a dict survives the codec."""
    return {"part": part, "key": key}


@dataclass(frozen=True)
class MixedView:
    """A mixture's views end to end: source ``s``'s index ``i`` is ``starts[s] + i``, key tagged."""

    parts: tuple[KeySnapshot, ...]

    @property
    def count(self) -> int:
        return sum(p.count for p in self.parts)

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([p.count for p in self.parts])])

    @property
    def chunk_size(self) -> int:
        return self.parts[0].chunk_size

    @property
    def chunks(self) -> tuple[str, ...]:
        return tuple(c for p in self.parts for c in p.chunks)

    @property
    def versions(self) -> tuple[str, ...] | None:
        found = [c for p in self.parts for c in p.versions or ()]
        return tuple(found) if any(p.versions is not None for p in self.parts) else None

    @property
    def fingerprint(self) -> str:
        parts = json.dumps([p.fingerprint for p in self.parts])
        return hashlib.sha256(parts.encode()).hexdigest()[:32]

    def _split(self, indexes: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(source, which of ``indexes``, their indexes in its view) per source they hit."""
        starts = self.starts
        part_of = np.searchsorted(starts, indexes, side="right") - 1
        for s in np.unique(part_of).tolist():
            mine = np.flatnonzero(part_of == s)
            yield s, mine, indexes[mine] - starts[s]

    def keys_at(self, store: Blobs, indexes: np.ndarray) -> list[Key]:
        out: list[Any] = [None] * len(indexes)
        for s, mine, at in self._split(np.asarray(indexes, dtype=np.int64)):
            for i, key in zip(mine.tolist(), self.parts[s].keys_at(store, at)):
                out[i] = tagged(s, key)
        return out

    def versions_at(self, store: Blobs, indexes: np.ndarray) -> list[Any]:
        out: list[Any] = [None] * len(indexes)
        for s, mine, at in self._split(np.asarray(indexes, dtype=np.int64)):
            if self.parts[s].versions is not None:
                for i, version in zip(mine.tolist(), self.parts[s].versions_at(store, at)):
                    out[i] = version
        return out

    def digests(self, store: Blobs) -> Iterator[np.ndarray]:
        for s, part in enumerate(self.parts):
            for start in range(0, part.count, part.chunk_size):
                keys = part.keys(store, start, start + part.chunk_size)
                yield key_digests([tagged(s, k) for k in keys])

    def to_record(self) -> dict[str, Any]:
        return {"parts": [p.to_record() for p in self.parts]}


View = KeySnapshot | MixedView


def view_from_record(data: dict[str, Any]) -> View:
    if isinstance(data, dict) and "parts" in data:
        return MixedView(tuple(KeySnapshot.from_record(p) for p in data["parts"]))
    return KeySnapshot.from_record(data)


@dataclass(frozen=True)
class RunSnapshot:
    """The training view (all rows without ``eval_fraction``) and the held-out one (by digest)."""

    query: str  # the query's fingerprint: a snapshot serves only the query it describes
    train: View
    held: View | None = None
    eval_fraction: float = 0.0
    fingerprint: str = ""  # what runs and models record of the data: changes with any key
    statements: int = field(default=0, compare=False)  # taking it (not recorded)

    @property
    def count(self) -> int:
        return self.train.count + (self.held.count if self.held else 0)

    def view(self, split: Split) -> View:
        """The keys a ``split`` reads: all rows, the training rows or the held-out rows."""
        if split == "held_out":
            return self.held or KeySnapshot(0, self.train.chunk_size, (), CODEC, "")
        if split == "all" and self.held is not None:
            raise ConfigError("this snapshot keeps training and held-out rows apart: no 'all'")
        return self.train

    def fits(self, query: Query, eval_fraction: float) -> bool:
        return self.query == query.fingerprint() and self.eval_fraction == max(eval_fraction, 0)

    def to_record(self) -> dict[str, Any]:
        return {
            "format": 1,
            "query": self.query,
            "eval_fraction": self.eval_fraction,
            "split": DIGEST,  # the held-out split's rule (llmtrain.db.keys.held_mask)
            "fingerprint": self.fingerprint,
            "train": self.train.to_record(),
            "held": None if self.held is None else self.held.to_record(),
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> RunSnapshot:
        if not isinstance(data, dict) or data.get("format") != 1:
            raise ConfigError(f"not a run snapshot record: {str(data)[:200]}")
        held = data.get("held")
        if held is not None and data.get("split", DIGEST) != DIGEST:
            raise ConfigError(
                f"this run's held-out split was decided by rule {data['split']!r}; this "
                f"llmtrain splits by {DIGEST!r} and cannot read its rows the same way"
            )
        return cls(
            str(data["query"]),
            view_from_record(data["train"]),
            None if held is None else view_from_record(held),
            float(data["eval_fraction"]),
            str(data["fingerprint"]),
        )


class ViewWriter:
    """Collects one view's keys (and versions), storing every chunk as it fills."""

    def __init__(self, store: Blobs, chunk_size: int, with_versions: bool) -> None:
        self.store, self.chunk_size, self.with_versions = store, chunk_size, with_versions
        self.held: list[Any] = []  # pieces of keys (int64 arrays or lists) not written yet
        self.held_versions: list[Any] = []
        self.chunks: list[str] = []
        self.version_chunks: list[str] = []
        self.count = 0

    def extend(self, keys: Any, versions: Sequence[Any] | None = None) -> None:
        self.held.append(keys)
        self.held_versions.append(list(versions or []))
        self.count += len(keys)
        if sum(map(len, self.held)) >= self.chunk_size:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        arrays = all(isinstance(k, np.ndarray) for k in self.held)
        keys: Any = np.concatenate(self.held) if arrays and self.held else _joined(self.held)
        versions = _joined(self.held_versions)
        n, size = len(keys), self.chunk_size
        stop = n if final else n - n % size
        for i in range(0, stop, size):
            self.chunks.append(self.store.put_bytes(encode_chunk(keys[i : i + size])))
            if self.with_versions:
                chunk = encode_chunk(versions[i : i + size])
                self.version_chunks.append(self.store.put_bytes(chunk))
        self.held, self.held_versions = [keys[stop:]], [versions[stop:]]

    def done(self) -> KeySnapshot:
        self._flush(final=True)
        versions = tuple(self.version_chunks) if self.with_versions else None
        chunks = tuple(self.chunks)
        fingerprint = KeySnapshot.digest(self.count, chunks, versions)
        return KeySnapshot(self.count, self.chunk_size, chunks, CODEC, fingerprint, versions)


def _joined(pieces: list[Any]) -> list[Any]:
    return [v for p in pieces for v in (p.tolist() if isinstance(p, np.ndarray) else p)]


def take_snapshot(
    db: Database,
    query: Query,
    *,
    eval_fraction: float = 0.0,
    chunk_size: int = CHUNK_SIZE,
    version_column: str | None = None,
    store: Blobs | None = None,
) -> RunSnapshot:
    """Keys (and ``version_column``) read once in keyset pages into chunks, split by digest."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    store = db.artifacts if store is None else store
    split = eval_fraction > 0
    fraction = float(eval_fraction) if split else 0.0
    if isinstance(query, Mix):  # each source its own snapshot, read as one
        take_part = functools.partial(take_snapshot, db, chunk_size=chunk_size, store=store)
        parts = [
            take_part(p.select, eval_fraction=eval_fraction, version_column=version_column)
            for p in query.parts
        ]
        train = MixedView(tuple(cast(KeySnapshot, p.train) for p in parts))
        held = MixedView(tuple(cast(KeySnapshot, p.held) for p in parts)) if split else None
        fingerprint = data_fingerprint(fraction, train, held)
        statements = sum(p.statements for p in parts)
        return RunSnapshot(query.fingerprint(), train, held, fraction, fingerprint, statements)
    version_column = version_column_of(query, version_column)
    train_keys = ViewWriter(store, chunk_size, bool(version_column))
    held_keys = ViewWriter(store, chunk_size, bool(version_column)) if split else None
    statements = 0
    for page in db.backend.key_pages(query, version_column, _KEY_PAGE):
        statements += 1
        if held_keys is None:
            train_keys.extend(page.keys, page.versions)
            continue
        mask = held_mask(key_digests(page.keys), eval_fraction)
        for view, take in ((train_keys, ~mask), (held_keys, mask)):
            picks, keys = np.flatnonzero(take), page.keys
            keys = keys[picks] if isinstance(keys, np.ndarray) else [keys[i] for i in picks]
            view.extend(keys, [page.versions[i] for i in picks] if page.versions else None)
    views = (train_keys.done(), held_keys.done() if held_keys is not None else None)
    fingerprint = data_fingerprint(fraction, *views)
    return RunSnapshot(query.fingerprint(), *views, fraction, fingerprint, statements)


def version_column_of(query: Query, version_column: str | None) -> str | None:
    """The column whose value is a row's version: a conversation's is its last turn."""
    return TURNS if isinstance(query, Conversations) else version_column


def value_counts(db: Database, query: Query, view: View, column: str) -> Counter[tuple[type, Any]]:
    """How many rows of ``view`` hold each value of ``column`` (by type too: 1.0 == 1), read in
    keyset pages like the snapshot (the column as version); rows added since do not count.
    1M rows: 0.8 s, against 0.35 s for the snapshot itself."""
    ours = np.sort(np.concatenate([np.zeros(0, dtype=np.uint64), *view.digests(db.artifacts)]))
    found: Counter[tuple[type, Any]] = Counter()
    for page in db.backend.key_pages(query, column, _KEY_PAGE) if len(ours) else ():
        digests = key_digests(page.keys)  # ours sorted once, searched per page (isin re-sorts)
        at = np.searchsorted(ours, digests).clip(max=len(ours) - 1)
        inside = (ours[at] == digests).tolist()
        found.update((type(v), v) for v, counted in zip(page.versions or (), inside) if counted)
    return found


def data_fingerprint(fraction: float, train: View, held: View | None) -> str:
    """What runs and models record of their rows: changes with any key, version or split."""
    digest = json.dumps([fraction, DIGEST, train.fingerprint, held.fingerprint if held else None])
    return hashlib.sha256(digest.encode()).hexdigest()[:32]
