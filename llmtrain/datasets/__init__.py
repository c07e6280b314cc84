"""Datasets that read straight from the database: all at once, or in cached windows."""

from llmtrain.datasets.cached import CachedQueryDataset, ReadStats
from llmtrain.datasets.loader import QueryDataLoader
from llmtrain.datasets.plan import rows_per_rank
from llmtrain.datasets.query import QueryDataset
from llmtrain.datasets.scan import SelectionScan, held_out, scan_selection

__all__ = [
    "CachedQueryDataset",
    "QueryDataLoader",
    "QueryDataset",
    "ReadStats",
    "SelectionScan",
    "held_out",
    "rows_per_rank",
    "scan_selection",
]
