"""Data backends by URI scheme: SQL through SQLAlchemy, MongoDB through pymongo/mongomock."""

from __future__ import annotations

from llmtrain.db.backend import DataBackend
from llmtrain.db.retry import RetryPolicy
from llmtrain.uri import is_mongo_uri


def open_backend(uri: str, *, retry: RetryPolicy | None = None) -> DataBackend:
    """``retry``: how long a read waits out a lost connection (default ``RetryPolicy()``)."""
    if is_mongo_uri(uri):
        from llmtrain.db.mongo import MongoBackend

        return MongoBackend(uri, retry=retry)
    from llmtrain.db.sql import SQLBackend

    return SQLBackend(uri, retry=retry)
