"""Artifacts in a local (or mounted) folder, each written to a temporary file beside it, fsynced
and renamed into place; a lock file keeps ``put_dir`` and ``delete`` from racing."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from llmtrain.stores.artifacts.base import ArtifactStore, copy_checked, id_path, os_error, tree_ids

try:  # POSIX: a lock file keeps put_dir and delete from racing; elsewhere best effort
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

TMP_PREFIX = ".tmp-"


class LocalArtifactStore(ArtifactStore):
    """Artifacts under ``root``; the folder is created on the first write."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().absolute()

    @property
    def location(self) -> str:
        return str(self.root)

    def _path(self, artifact_id: str) -> Path:
        return self.root.joinpath(*id_path(artifact_id))

    def _has(self, artifact_id: str) -> bool:
        return self._path(artifact_id).is_file()

    def _save(self, artifact_id: str, source: BinaryIO) -> None:
        final = self._path(artifact_id)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=TMP_PREFIX)
        except OSError as exc:
            raise os_error(f"cannot write artifacts under {self.root}", exc) from exc
        try:
            with os.fdopen(fd, "wb") as out:
                copy_checked(source, out, artifact_id)
                os.fchmod(out.fileno(), 0o644)  # mkstemp's 0600 would hide it from a team
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
        except BaseException as exc:
            with suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise os_error(f"cannot write {artifact_id} under {self.root}", exc) from exc
            raise
        with suppress(OSError):  # make the rename durable; some filesystems cannot
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _open(self, artifact_id: str) -> BinaryIO:
        try:
            return open(self._path(artifact_id), "rb")
        except FileNotFoundError:
            raise self._not_found(artifact_id, self.root) from None
        except OSError as exc:
            raise os_error(f"cannot read {artifact_id} from {self.root}", exc) from exc

    def _remove(self, artifact_id: str) -> None:
        try:
            self._path(artifact_id).unlink(missing_ok=True)
        except OSError as exc:
            raise os_error(f"cannot delete {artifact_id} from {self.root}", exc) from exc

    def _tree_ids(self) -> list[str]:
        return tree_ids((p.parent.name, p.name) for p in (self.root / "trees").glob("??/*"))

    @contextmanager
    def _tree_lock(self, exclusive: bool) -> Iterator[None]:
        if fcntl is None or (not exclusive and not self.root.is_dir()):
            yield  # a reader of a folder that is not there finds nothing: create nothing
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            handle = open(self.root / ".lock", "a+b")  # noqa: SIM115 - held across the yield
        except OSError as exc:
            raise os_error(f"cannot write artifacts under {self.root}", exc) from exc
        with handle:  # closing the file releases the lock
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
