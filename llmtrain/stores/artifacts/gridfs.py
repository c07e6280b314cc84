"""GridFS in the metadata database, the id as ``filename`` (unique): the file document follows the
last chunk, so no reader sees a partial artifact; a writer losing a race drops only its chunks."""

from __future__ import annotations

import functools
from contextlib import suppress
from typing import Any, BinaryIO, cast

from pymongo.errors import PyMongoError

from llmtrain.db.engines import mongo_database
from llmtrain.errors import ArtifactCorruptError
from llmtrain.stores.artifacts.base import TREE, ArtifactStore, copy_checked
from llmtrain.stores.metadata.base import TABLE_PREFIX
from llmtrain.uri import redact_uri, scheme_of

COLLECTION = f"{TABLE_PREFIX}artifacts"  # GridFS adds .files and .chunks


@functools.cache
def _enable_mongomock_gridfs() -> None:
    """gridfs checks ``isinstance(db, pymongo.Database)``; mongomock patches that (twice: fine)."""
    import mongomock.gridfs

    mongomock.gridfs.enable_gridfs_integration()


class GridFSArtifactStore(ArtifactStore):
    _storage_errors = (PyMongoError,)

    def __init__(self, metadata_uri: str) -> None:
        self._uri = metadata_uri
        self._where = redact_uri(metadata_uri)
        self._label = f"GridFS artifacts in {self._where}"
        self._index_ready = False

    def __repr__(self) -> str:
        return f"GridFSArtifactStore({self._where!r})"

    @property
    def location(self) -> str:
        return "gridfs"

    def _db(self, *, write: bool = False) -> Any:
        """The database; for a write, after the unique index exists (reads create nothing)."""
        if scheme_of(self._uri) == "mongomock":
            _enable_mongomock_gridfs()
        db = mongo_database(self._uri)
        if write and not self._index_ready:
            with self._errors("preparing"):
                self._files(db).create_index("filename", unique=True, name="llmtrain_artifact_id")
            self._index_ready = True
        return db

    def _files(self, db: Any = None) -> Any:
        return (self._db() if db is None else db)[f"{COLLECTION}.files"]

    def _fs(self, *, write: bool = False) -> Any:
        import gridfs

        return gridfs.GridFS(self._db(write=write), collection=COLLECTION)

    def _file_doc(self, artifact_id: str) -> dict[str, Any] | None:
        with self._errors(f"looking up {artifact_id}"):
            return self._files().find_one({"filename": artifact_id})

    def _has(self, artifact_id: str) -> bool:
        return self._file_doc(artifact_id) is not None

    def _save(self, artifact_id: str, source: BinaryIO) -> None:
        import gridfs

        grid_in = self._fs(write=True).new_file(filename=artifact_id)
        with self._errors(f"storing {artifact_id}"):
            try:
                copy_checked(source, grid_in, artifact_id)
                grid_in.close()
            except gridfs.errors.FileExists:
                self._drop_chunks(grid_in._id)  # another writer stored the same content first
            except BaseException:
                self._drop_chunks(grid_in._id)
                raise

    def _drop_chunks(self, file_id: Any) -> None:
        with suppress(PyMongoError):  # orphaned chunks are invisible; a crash leaves the same
            self._db()[f"{COLLECTION}.chunks"].delete_many({"files_id": file_id})

    def _open(self, artifact_id: str) -> BinaryIO:
        doc = self._file_doc(artifact_id)
        if doc is None:
            raise self._not_found(artifact_id, f"{self._where} (GridFS)")
        with self._errors(f"reading {artifact_id}"):
            return cast(BinaryIO, self._fs().get(doc["_id"]))

    def _copy_verified(self, artifact_id: str, out: Any) -> None:
        """Damaged chunks surface as ArtifactCorruptError, like a bad hash."""
        import gridfs

        with self._errors(f"reading {artifact_id}"):
            try:
                super()._copy_verified(artifact_id, out)
            except gridfs.errors.CorruptGridFile as exc:
                raise ArtifactCorruptError(f"artifact {artifact_id} is corrupt: {exc}") from exc

    def _remove(self, artifact_id: str) -> None:
        doc = self._file_doc(artifact_id)
        if doc is not None:
            with self._errors(f"deleting {artifact_id}"):
                self._fs().delete(doc["_id"])  # the file document first, then its chunks

    def _tree_ids(self) -> list[str]:
        with self._errors("listing folder artifacts"):
            docs = self._files().find({"filename": {"$regex": f"^{TREE}:"}}, {"filename": 1})
            return sorted(d["filename"] for d in docs)
