"""Where checkpoints, adapters and models are kept: a folder, or GridFS next to the metadata."""

from __future__ import annotations

from pathlib import Path

from llmtrain.artifacts.base import ArtifactStore
from llmtrain.artifacts.local import LocalArtifactStore
from llmtrain.errors import ConfigError
from llmtrain.uri import is_mongo_uri, redact_uri

__all__ = ["ArtifactStore", "LocalArtifactStore", "open_artifacts"]


def open_artifacts(spec: str | Path, *, metadata_uri: str) -> ArtifactStore:
    """``"gridfs"``: GridFS in the (MongoDB) metadata database; anything else: a folder."""
    if isinstance(spec, str) and spec == "gridfs":
        if not is_mongo_uri(metadata_uri):
            raise ConfigError(f"artifacts='gridfs' needs a MongoDB metadata database, not "
                              f"{redact_uri(metadata_uri)}")
        from llmtrain.artifacts.gridfs import GridFSArtifactStore

        return GridFSArtifactStore(metadata_uri)
    return LocalArtifactStore(spec)
