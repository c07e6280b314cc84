"""Where components and runs are recorded: ``open_metadata(uri)`` picks SQL or MongoDB."""

from __future__ import annotations

from llmtrain.stores.metadata.base import MetadataStore
from llmtrain.uri import is_mongo_uri


def open_metadata(uri: str, *, missing_ok: bool = False) -> MetadataStore:
    """Connects on first use; ``missing_ok``: a database not there yet reads as empty."""
    if is_mongo_uri(uri):
        from llmtrain.stores.metadata.mongo import MongoMetadataStore

        return MongoMetadataStore(uri, missing_ok=missing_ok)
    from llmtrain.stores.metadata.sql import SQLMetadataStore

    return SQLMetadataStore(uri, missing_ok=missing_ok)
