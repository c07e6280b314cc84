"""QueryDataset: the whole selection read once into memory, for small data and eval sets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from llmtrain.data.cached import ReadStats
from llmtrain.data.rows import Shape, check_on_bad_row, check_row, normalise_fields
from llmtrain.data.snapshot import CHUNK_SIZE, MemoryStore, ViewWriter, data_fingerprint
from llmtrain.db.backend import Row
from llmtrain.db.queries import Conversations, Query
from llmtrain.errors import ConfigError

if TYPE_CHECKING:
    from llmtrain.stores.handle import Database


class QueryDataset(Dataset[Row]):
    """Map-style: ``len()`` and indexing over rows read in key order with keyset pages."""

    def __init__(
        self,
        db: Database,
        select: Query,
        fields: str | Sequence[str],
        *,
        page_size: int = 10_000,
        on_bad_row: str = "raise",
        return_keys: bool = False,
    ) -> None:
        if not isinstance(select, Query):
            raise ConfigError(f"select must be a llmtrain query, got {type(select).__name__}")
        self.db, self.query, self.fields = db, select, normalise_fields(fields)
        self.on_bad_row, self.return_keys = check_on_bad_row(on_bad_row), return_keys
        self.stats = ReadStats()
        self.keys: list[Any] = []
        self.rows: list[Row] = []
        keys = ViewWriter(MemoryStore(), CHUNK_SIZE, with_versions=False)
        shape: Shape = "conversation" if isinstance(select, Conversations) else "text"
        for page in db.backend.pages(select, self.fields, page_size):
            keys.extend([k for k, _ in page])
            self.stats.statements += 1
            self.stats.rows_fetched += len(page)
            for key, row in page:
                if check_row(select.source, key, row, self.fields, self.on_bad_row, shape=shape):
                    self.keys.append(key)
                    self.rows.append({**row, "_key": key} if return_keys else row)
                else:
                    self.stats.skipped += 1
                    self.stats.skipped_keys.append(key)
        # the fingerprint of the same keys a snapshot would take: read once, not twice
        self.data_fingerprint = data_fingerprint(0.0, keys.done(), None)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]
