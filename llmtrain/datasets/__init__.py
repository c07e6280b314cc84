"""Datasets that read straight from the database: all at once, or in cached windows."""

from llmtrain.datasets.cached import CachedQueryDataset, ReadStats
from llmtrain.datasets.loader import QueryDataLoader
from llmtrain.datasets.plan import rows_per_rank
from llmtrain.datasets.query import QueryDataset

__all__ = ["CachedQueryDataset", "QueryDataLoader", "QueryDataset", "ReadStats", "rows_per_rank"]
