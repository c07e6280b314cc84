"""Datasets that read straight from the database: all at once, or in cached windows."""

from llmtrain.data.cached import CachedQueryDataset
from llmtrain.data.loader import QueryDataLoader
from llmtrain.data.query import QueryDataset
from llmtrain.data.snapshot import RunSnapshot, take_snapshot
from llmtrain.db.keys import held_out

__all__ = [
    "CachedQueryDataset",
    "QueryDataLoader",
    "QueryDataset",
    "RunSnapshot",
    "held_out",
    "take_snapshot",
]
