"""Where checkpoints, adapters and models are kept: a folder, or GridFS next to the metadata."""

from __future__ import annotations

import re
from pathlib import Path

from llmtrain.artifacts.base import ArtifactStore
from llmtrain.artifacts.local import LocalArtifactStore
from llmtrain.errors import ConfigError
from llmtrain.uri import is_mongo_uri, redact_uri

__all__ = ["ArtifactStore", "LocalArtifactStore", "check_artifacts_spec", "open_artifacts"]
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


def check_artifacts_spec(spec: str | Path) -> None:
    """A URL whose scheme no store handles (``s3://``) is refused, never taken for a folder
    named ``s3:``; ``file://`` is the local folder."""
    if not isinstance(spec, str):
        return
    match = _URL.match(spec)
    if match and match.group(1).lower() != "file":
        raise ConfigError(
            f"artifacts={redact_uri(spec)!r}: no artifact store handles "
            f"{match.group(1)}:// URLs; use a folder, 'gridfs' or an ArtifactStore"
        )


def open_artifacts(spec: str | Path, *, metadata_uri: str) -> ArtifactStore:
    """``"gridfs"``: GridFS in the (MongoDB) metadata database; anything else: a folder."""
    check_artifacts_spec(spec)
    if isinstance(spec, str) and spec == "gridfs":
        if not is_mongo_uri(metadata_uri):
            raise ConfigError(
                f"artifacts='gridfs' needs a MongoDB metadata database, not "
                f"{redact_uri(metadata_uri)}"
            )
        from llmtrain.artifacts.gridfs import GridFSArtifactStore

        return GridFSArtifactStore(metadata_uri)
    if isinstance(spec, str) and spec.lower().startswith("file://"):
        spec = spec[len("file://") :]
    return LocalArtifactStore(spec)
