"""Datasets that read straight from the database: all at once, or in cached windows."""

from llmtrain.datasets.cached import CachedQueryDataset, ReadStats
from llmtrain.datasets.loader import QueryDataLoader
from llmtrain.datasets.plan import rows_per_rank
from llmtrain.datasets.query import QueryDataset
from llmtrain.datasets.snapshot import KeySnapshot, RunSnapshot, held_out, take_snapshot

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
