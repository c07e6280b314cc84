"""Where checkpoints, adapters and models are kept: a folder, GridFS or an fsspec URL."""

from __future__ import annotations

from pathlib import Path

from llmtrain.errors import ConfigError
from llmtrain.stores.artifacts.base import ArtifactStore
from llmtrain.stores.artifacts.fsspec_store import URL_SCHEME, FsspecArtifactStore, check_url
from llmtrain.stores.artifacts.local import LocalArtifactStore
from llmtrain.uri import is_mongo_uri, redact_uri


def is_url(spec: str | Path) -> bool:
    """An fsspec URL (``s3://...``); ``file://`` is the local folder, not one of these."""
    match = URL_SCHEME.match(spec) if isinstance(spec, str) else None
    return match is not None and match.group(1).lower() != "file"


def check_artifacts_spec(spec: str | Path, metadata_uri: str) -> None:
    """Before anything opens: ``"gridfs"`` needs MongoDB metadata, a URL a safe fsspec URL."""
    if spec == "gridfs" and not is_mongo_uri(metadata_uri):
        raise ConfigError(
            f"artifacts='gridfs' needs a MongoDB metadata database, not {redact_uri(metadata_uri)}"
        )
    if is_url(spec):
        check_url(str(spec))


def open_artifacts(spec: str | Path, *, metadata_uri: str) -> ArtifactStore:
    """GridFS in the metadata database, an fsspec URL, or a folder (``file://`` included)."""
    check_artifacts_spec(spec, metadata_uri)
    if is_url(spec):
        return FsspecArtifactStore(str(spec))
    if spec == "gridfs":
        from llmtrain.stores.artifacts.gridfs import GridFSArtifactStore

        return GridFSArtifactStore(metadata_uri)
    if isinstance(spec, str) and spec.lower().startswith("file://"):
        spec = spec[len("file://") :]
    return LocalArtifactStore(spec)
