"""Where checkpoints, adapters and models are kept: a folder or an fsspec URL."""

from __future__ import annotations

from pathlib import Path

from llmtrain.errors import ConfigError
from llmtrain.stores.artifacts.base import ArtifactStore
from llmtrain.stores.artifacts.fsspec_store import URL_SCHEME, FsspecArtifactStore, check_url
from llmtrain.stores.artifacts.local import LocalArtifactStore


def is_url(spec: str | Path) -> bool:
    """An fsspec URL (``s3://...``); ``file://`` is the local folder, not one of these."""
    match = URL_SCHEME.match(spec) if isinstance(spec, str) else None
    return match is not None and match.group(1).lower() != "file"


def check_artifacts_spec(spec: str | Path) -> None:
    """Before anything opens: a URL must be a safe fsspec URL; ``"gridfs"`` is gone."""
    if spec == "gridfs":
        raise ConfigError(
            "artifacts='gridfs' is no longer supported: use a folder or an fsspec URL "
            "such as s3://bucket/prefix"
        )
    if is_url(spec):
        check_url(str(spec))


def open_artifacts(spec: str | Path) -> ArtifactStore:
    """An fsspec URL, or a folder (``file://`` included)."""
    check_artifacts_spec(spec)
    if is_url(spec):
        return FsspecArtifactStore(str(spec))
    if isinstance(spec, str) and spec.lower().startswith("file://"):
        spec = spec[len("file://") :]
    return LocalArtifactStore(spec)
