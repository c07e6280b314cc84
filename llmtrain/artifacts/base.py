"""The artifact store: content-addressed blobs and folders (checkpoints, adapters, models)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class ArtifactStore(ABC):
    """Immutable, content-addressed storage.

    An artifact id is ``"sha256:<hex>"`` for a blob, or ``"tree:<hex>"`` for a folder
    (the hash of its JSON manifest of relative paths -> blob ids). Writes go to a temporary
    name and are renamed into place; reads verify the hash.
    """

    @abstractmethod
    def put_bytes(self, data: bytes) -> str: ...

    @abstractmethod
    def put_file(self, path: str | Path) -> str: ...

    @abstractmethod
    def put_dir(self, path: str | Path) -> str:
        """Store every regular file below ``path``; return a ``tree:`` id."""

    @abstractmethod
    def get_bytes(self, artifact_id: str) -> bytes:
        """The blob's bytes, verified; ArtifactCorruptError if they no longer match."""

    @abstractmethod
    def get_dir(self, artifact_id: str, dest: str | Path) -> Path:
        """Materialise a tree into ``dest`` (created; must be empty or absent), verified."""

    @abstractmethod
    def exists(self, artifact_id: str) -> bool: ...

    @abstractmethod
    def delete(self, artifact_id: str) -> None:
        """Delete a blob, or a tree's manifest and those of its blobs no other tree uses."""

    def put(self, obj: bytes | str | Path) -> str:
        """Bytes, a file path or a folder path."""
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return self.put_bytes(bytes(obj))
        path = Path(obj)
        return self.put_dir(path) if path.is_dir() else self.put_file(path)
