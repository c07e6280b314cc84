"""The artifact store contract: ids are ``sha256:<hex>`` (a blob) or ``tree:<hex>`` (a folder's
JSON manifest: relative path -> blob id); content-addressed, atomic, verified on read."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from llmtrain.errors import ArtifactCorruptError, ArtifactNotFoundError, LlmtrainError, StoreError

BLOB, TREE = "sha256", "tree"
_ID = re.compile(r"(sha256|tree):([0-9a-f]{64})")
_UNSAFE = re.compile(r"(^|/)\.{0,2}(/|\Z)|[\\\0]")  # an empty, . or .. part, \ or NUL
CHUNK = 1 << 20
MANIFEST_FORMAT = 1


def parse_id(artifact_id: object) -> tuple[str, str]:
    """``(kind, hex)``; anything else is refused, so an id can never name a path."""
    match = _ID.fullmatch(artifact_id) if isinstance(artifact_id, str) else None
    if match is None:
        shown = repr(artifact_id)[:100]
        raise StoreError(
            f"invalid artifact id {shown}: expected 'sha256:<64 hex>' or 'tree:<64 hex>'"
        )
    return match.group(1), match.group(2)


def id_path(artifact_id: str) -> tuple[str, str, str]:
    """Where a folder-like store keeps it: ``blobs/ab/cdef...`` or ``trees/ab/cdef...``."""
    kind, hexdigest = parse_id(artifact_id)
    return "blobs" if kind == BLOB else "trees", hexdigest[:2], hexdigest[2:]


def tree_ids(names: Iterable[Sequence[str]]) -> list[str]:
    """The tree ids of stored ``(ab, cdef...)`` names, sorted; temporary files are skipped."""
    ids = (f"{TREE}:{head}{name}" for head, name in names)
    return sorted(i for i in ids if _ID.fullmatch(i))


def check_relpath(relpath: object) -> str:
    """A manifest path: relative, ``/``-separated, no empty, ``.`` or ``..`` parts."""
    if not isinstance(relpath, str) or _UNSAFE.search(relpath):
        raise StoreError(
            f"unsafe path {str(relpath)[:200]!r} in a folder artifact: paths "
            "must be relative, '/'-separated, without '.' or '..' parts"
        )
    return relpath


def manifest_bytes(files: dict[str, str]) -> bytes:
    """Canonical JSON, so the same folder content always gives the same tree id."""
    return json.dumps(
        {"format": MANIFEST_FORMAT, "files": files}, sort_keys=True, separators=(",", ":")
    ).encode()


def hashed_copy(source: BinaryIO, out: Any = None) -> str:
    """Copy ``source`` to ``out`` (if any) in ``CHUNK`` pieces; the sha256 of what was read."""
    digest = hashlib.sha256()
    while chunk := source.read(CHUNK):
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
    return digest.hexdigest()


def copy_checked(source: BinaryIO, out: Any, artifact_id: str) -> None:
    """Copy, then refuse to publish bytes that are not the ones the id was hashed from."""
    if hashed_copy(source, out) != parse_id(artifact_id)[1]:
        raise StoreError(
            f"the content of {artifact_id} changed while it was being "
            "stored (was the file modified?); nothing was stored"
        )


def os_error(what: str, exc: OSError) -> StoreError:
    hint = " (disk full?)" if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)) else ""
    return StoreError(f"{what}: {exc.strerror or exc}{hint}")


class ArtifactStore(ABC):
    """Ids, trees, verification and deletion over the ``_``-primitives each store supplies."""

    #: where the artifacts are, for messages; the storage's exceptions that :meth:`_errors` wraps
    _label = "artifacts"
    _storage_errors: tuple[type[Exception], ...] = ()

    @property
    @abstractmethod
    def location(self) -> str:
        """As ``connect(artifacts=)`` takes it (no secret in it): recorded on runs and models."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    def _not_found(self, artifact_id: str, where: object) -> ArtifactNotFoundError:
        return ArtifactNotFoundError(f"artifact {artifact_id} not found in {where}")

    def _error(self, what: str, exc: BaseException) -> StoreError:
        return StoreError(f"{self._label}: {what} failed: {type(exc).__name__}: {exc}")

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except LlmtrainError:
            raise
        except self._storage_errors as exc:
            raise self._error(what, exc) from exc

    @abstractmethod
    def _has(self, artifact_id: str) -> bool: ...

    @abstractmethod
    def _save(self, artifact_id: str, source: BinaryIO) -> None:
        """Store ``source`` under the id (via :func:`copy_checked`); visible only once complete."""

    @abstractmethod
    def _open(self, artifact_id: str) -> BinaryIO:
        """A readable stream; ArtifactNotFoundError naming the id if it is absent."""

    @abstractmethod
    def _remove(self, artifact_id: str) -> None:
        """If present."""

    @abstractmethod
    def _tree_ids(self) -> list[str]: ...

    @contextmanager
    def _tree_lock(self, exclusive: bool) -> Iterator[None]:
        """Held shared by put_dir and exclusive by delete, where the store can lock."""
        yield

    def require(self, artifact_id: str, recorded: str | None, what: str) -> None:
        """ArtifactNotFoundError, naming where ``what`` recorded its artifacts if elsewhere."""
        if self.exists(artifact_id):
            return
        message = f"artifact {artifact_id} of {what} is not in {self.location}"
        if recorded and recorded != self.location:
            message += (
                f"; {what} stored its artifacts in {recorded}: open the database with "
                f"artifacts={recorded!r} (llmtrain ... --artifacts {recorded})"
            )
        raise ArtifactNotFoundError(message)

    def put(self, obj: bytes | str | Path) -> str:
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return self.put_bytes(bytes(obj))
        path = Path(obj)
        return self.put_dir(path) if path.is_dir() else self.put_file(path)

    def put_bytes(self, data: bytes) -> str:
        return self._put_data(BLOB, data)

    def _put_data(self, kind: str, data: bytes) -> str:
        artifact_id = f"{kind}:{hashlib.sha256(data).hexdigest()}"
        if not self._has(artifact_id):
            self._save(artifact_id, io.BytesIO(data))
        return artifact_id

    def put_file(self, path: str | Path) -> str:
        path = Path(path)
        if not path.is_file():
            raise StoreError(f"cannot store {path}: not a regular file")
        try:
            with open(path, "rb") as f:
                artifact_id = f"{BLOB}:{hashed_copy(f)}"
            if not self._has(artifact_id):
                with open(path, "rb") as f:
                    self._save(artifact_id, f)  # re-hashed on the way: a changed file fails
        except OSError as exc:
            raise os_error(f"cannot read {path}", exc) from exc
        return artifact_id

    def put_dir(self, path: str | Path) -> str:
        """Files (and links to files, not folders) below ``path`` as a ``tree:`` id."""
        path = Path(path)
        if not path.is_dir():
            raise StoreError(f"cannot store {path}: not a folder")
        with self._tree_lock(exclusive=False):
            files: dict[str, str] = {}
            for folder, subdirs, names in os.walk(path):
                subdirs.sort()
                for name in sorted(names):
                    file = Path(folder, name)
                    if file.is_file():
                        relpath = check_relpath(file.relative_to(path).as_posix())
                        files[relpath] = self.put_file(file)
            return self._put_data(TREE, manifest_bytes(files))

    def exists(self, artifact_id: str) -> bool:
        parse_id(artifact_id)
        return self._has(artifact_id)

    def get_bytes(self, artifact_id: str) -> bytes:
        parse_id(artifact_id)
        out = io.BytesIO()
        self._copy_verified(artifact_id, out)
        return out.getvalue()

    def _copy_verified(self, artifact_id: str, out: Any) -> None:
        """ArtifactCorruptError if the bytes no longer hash to the id."""
        with self._open(artifact_id) as source:
            actual = hashed_copy(source, out)
        if actual != parse_id(artifact_id)[1]:
            raise ArtifactCorruptError(
                f"artifact {artifact_id} is corrupt: its content now hashes "
                f"to {actual[:16]}...; restore it from a copy or delete it"
            )

    def get_dir(self, artifact_id: str, dest: str | Path) -> Path:
        """A tree into ``dest`` (empty or absent) via a sibling folder renamed into place."""
        if parse_id(artifact_id)[0] != TREE:
            raise StoreError(f"{artifact_id} is a blob, not a folder: use get_bytes")
        files = self._tree_files(artifact_id)
        dest = Path(dest)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise StoreError(f"cannot restore {artifact_id} into {dest}: it is not an empty folder")
        staging = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.partial"
        try:
            staging.mkdir(parents=True)
            for relpath, blob_id in files.items():
                target = staging.joinpath(*relpath.split("/"))
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "xb") as out:
                    self._copy_verified(blob_id, out)
            os.replace(staging, dest)
        except OSError as exc:
            raise os_error(f"cannot restore {artifact_id} into {dest}", exc) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone once renamed into place
        return dest

    def _tree_files(self, tree_id: str) -> dict[str, str]:
        try:
            manifest = json.loads(self.get_bytes(tree_id))
            files = manifest["files"] if manifest.get("format") == MANIFEST_FORMAT else None
        except (ValueError, AttributeError, KeyError):  # not JSON, not an object, no files
            files = None
        if not isinstance(files, dict):
            raise StoreError(f"{tree_id} is not a format-{MANIFEST_FORMAT} folder manifest")
        for relpath, blob_id in files.items():
            check_relpath(relpath)
            if parse_id(blob_id)[0] != BLOB:
                raise StoreError(f"{tree_id}: entry {relpath!r} is not a blob id")
        return files

    def delete(self, artifact_id: str) -> None:
        """A blob (refused while a tree uses it), or a tree with the blobs no other tree uses."""
        kind, _ = parse_id(artifact_id)
        with self._tree_lock(exclusive=True):
            if not self._has(artifact_id):
                return
            others = {t: self._tree_files(t) for t in self._tree_ids() if t != artifact_id}
            if kind == BLOB:
                users = [t for t, files in others.items() if artifact_id in files.values()]
                if users:
                    raise StoreError(
                        f"{artifact_id} is part of {users[0]}: delete the folder artifact instead"
                    )
                self._remove(artifact_id)
                return
            try:
                mine = set(self._tree_files(artifact_id).values())
            except ArtifactCorruptError:
                mine = set()  # its list cannot be trusted: keep the blobs, drop the manifest
            used = {b for files in others.values() for b in files.values()}
            self._remove(artifact_id)  # first: a failure below leaves only unused blobs
            for blob_id in sorted(mine - used):
                self._remove(blob_id)
