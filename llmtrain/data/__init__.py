"""Datasets that read straight from the database: all at once, or in cached windows."""

from llmtrain.data.cached import CachedQueryDataset, ReadStats
from llmtrain.data.loader import QueryDataLoader
from llmtrain.data.plan import rows_per_rank
from llmtrain.data.query import QueryDataset
from llmtrain.data.snapshot import KeySnapshot, RunSnapshot, take_snapshot
from llmtrain.db.keys import held_out

__all__ = [
    "CachedQueryDataset",
    "QueryDataLoader",
    "QueryDataset",
    "KeySnapshot",
    "ReadStats",
    "RunSnapshot",
    "held_out",
    "rows_per_rank",
    "take_snapshot",
]
