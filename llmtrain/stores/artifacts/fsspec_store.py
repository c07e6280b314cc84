"""Artifacts at an fsspec URL, laid out as a local folder; credentials from the environment, never
the URL (stored, shown). S3/GCS ``commit()`` a multipart upload once hashed, others move tmp/<uuid>.
No lock across machines: a ``delete`` racing a ``put_dir`` sharing blobs can drop one it needs."""

from __future__ import annotations

import posixpath
import re
import uuid
from contextlib import suppress
from typing import Any, BinaryIO, cast
from urllib.parse import urlsplit

from llmtrain.errors import ConfigError, LlmtrainError
from llmtrain.stores.artifacts.base import CHUNK, ArtifactStore, copy_checked, id_path, tree_ids

URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
ATOMIC_COMMIT = frozenset({"s3", "s3a", "gs", "gcs"})  # autocommit=False: visible on commit()
WRITE_BLOCK = 16 << 20  # S3 parts are 5 MiB or more; 16 MiB parts allow objects up to 160 GB
READ_BLOCK = 4 * CHUNK
#: protocols fsspec reads but cannot write (or that wrap another URL): no place for artifacts
READ_ONLY = frozenset({"http", "https", "github", "zip", "tar", "libarchive", "reference"})
STORAGE_PACKAGES = frozenset({"fsspec", "s3fs", "botocore", "aiobotocore", "gcsfs", "google"})


def check_url(url: str, option: str = "artifacts") -> str:
    """The protocol of an fsspec URL that is safe to store; else ConfigError naming ``option``."""
    match = URL_SCHEME.match(url)
    if match is None:
        raise ConfigError(f"{option}={url!r} is not a URL")
    protocol = match.group(1).lower()
    parts = urlsplit(url)
    if "@" in parts.netloc or parts.query or parts.fragment:
        host = parts.netloc.rsplit("@", 1)[-1]
        hidden = "***@" if "@" in parts.netloc else ""
        shown = f"{parts.scheme}://{hidden}{host}{parts.path}" + ("?***" if parts.query else "")
        raise ConfigError(
            f"{option}={shown!r}: credentials and options do not belong in the "
            "URL (it is stored and shown); set them in the environment "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_ENDPOINT_URL, "
            "FSSPEC_<PROTOCOL>_<OPTION>)"
        )
    if any(part in (".", "..") for part in parts.path.split("/")):
        raise ConfigError(f"{option}={url!r}: '.' and '..' are not allowed in the path")
    import fsspec

    if protocol in READ_ONLY or protocol not in fsspec.available_protocols():
        raise ConfigError(
            f"{option}={url!r}: no artifact store handles {match.group(1)}:// URLs; use a "
            "folder, an fsspec URL (s3://, gs://, memory://) or an ArtifactStore"
        )
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        hint = " (pip install 'llmtrain[s3]')" if protocol in ("s3", "s3a") else ""
        raise ConfigError(f"{option}={url!r} needs a package fsspec names: {exc}{hint}") from None
    return protocol


class FsspecArtifactStore(ArtifactStore):
    """The filesystem opens on first use (and again after pickling: only the URL travels)."""

    _storage_errors = (Exception,)  # whatever the driver raises

    def __init__(self, url: str) -> None:
        self.protocol = check_url(url)
        self.url = url.rstrip("/")
        self._label = f"artifacts at {self.url}"
        self._fs: Any = None
        self._root = ""

    @property
    def location(self) -> str:
        return self.url

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    @property
    def fs(self) -> Any:
        if self._fs is None:
            from fsspec.core import url_to_fs

            with self._errors("opening"):  # no listings cache: others' changes show at once
                self._fs, root = url_to_fs(self.url, use_listings_cache=False)
            self._root = root.rstrip("/")
        return self._fs

    def _join(self, *parts: str) -> str:
        """A path below the root, as the filesystem names it (opens it if need be)."""
        _ = self.fs
        return posixpath.join(self._root, *parts)

    def _path(self, artifact_id: str) -> str:
        return self._join(*id_path(artifact_id))

    def _has(self, artifact_id: str) -> bool:
        with self._errors(f"looking up {artifact_id}"):
            return bool(self.fs.isfile(self._path(artifact_id)))

    def _save(self, artifact_id: str, source: BinaryIO) -> None:
        final = self._path(artifact_id)
        direct = self.protocol in ATOMIC_COMMIT
        target = final if direct else self._join("tmp", uuid.uuid4().hex)
        with self._errors(f"storing {artifact_id}"):
            out = self.fs.open(target, "wb", block_size=WRITE_BLOCK, autocommit=not direct)
        try:
            copy_checked(source, out, artifact_id)
            out.close()  # object stores: parts uploaded, object not yet visible
            if direct:
                out.commit()
            else:
                self.fs.mv(target, final)
        except BaseException as exc:
            self._abandon(out, target, direct)
            package = type(exc).__module__.split(".", 1)[0]
            storage = isinstance(exc, OSError) or package in STORAGE_PACKAGES
            if not storage or not isinstance(exc, Exception) or isinstance(exc, LlmtrainError):
                raise  # an interrupt, ours, or the source's (a file that cannot be read)
            raise self._error(f"storing {artifact_id}", exc) from exc

    def _abandon(self, out: Any, target: str, direct: bool) -> None:
        """Throw a failed write away; a crash leaves the same (invisible) leftovers."""
        with suppress(Exception):
            if direct:
                out.discard()  # aborts the multipart upload
                out.closed = True  # nothing left to flush when the file is collected
            else:
                out.close()
                self.fs.rm_file(target)

    def _open(self, artifact_id: str) -> BinaryIO:
        with self._errors(f"reading {artifact_id}"):
            try:
                path = self._path(artifact_id)
                return cast(BinaryIO, self.fs.open(path, "rb", block_size=READ_BLOCK))
            except FileNotFoundError:
                raise self._not_found(artifact_id, self.url) from None

    def _remove(self, artifact_id: str) -> None:
        with self._errors(f"deleting {artifact_id}"), suppress(FileNotFoundError):
            self.fs.rm_file(self._path(artifact_id))  # S3 deletes a missing key without a word

    def _tree_ids(self) -> list[str]:
        with self._errors("listing folder artifacts"):
            try:
                paths = self.fs.find(self._join("trees"))
            except FileNotFoundError:
                return []
        return tree_ids(str(path).rstrip("/").split("/")[-2:] for path in paths)
