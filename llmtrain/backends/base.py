"""The data backend: the few keyset operations every dataset is built from.

Every read is one short statement: ``key >= lower ORDER BY key LIMIT n`` (or the Mongo
equivalent). No cursor or transaction stays open between calls, so a slow consumer
never pins the database.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from llmtrain.queries import Query

Key = Any
Row = dict[str, Any]


class DataBackend(ABC):
    """Reads rows of a query in key order. Implementations must be safe to pickle."""

    #: redacted URI, safe to show and store
    uri: str

    @abstractmethod
    def key_name(self, query: Query) -> str:
        """The column/field the query is paged on; QueryError if there is no usable one."""

    @abstractmethod
    def fetch_rows(
        self,
        query: Query,
        fields: Sequence[str],
        lower: Key | None,
        limit: int,
        *,
        inclusive: bool = True,
    ) -> list[tuple[Key, Row]]:
        """Up to ``limit`` rows with key >= lower (> when not inclusive), in key order.

        Each row is ``(key, {field: value})``; a field absent from the row is absent from the
        dict (the caller decides whether that is an error). Dotted Mongo paths are resolved.
        """

    @abstractmethod
    def fetch_by_keys(
        self, query: Query, fields: Sequence[str], keys: Sequence[Key]
    ) -> list[tuple[Key, Row]]:
        """The rows with exactly these keys (any order; missing keys are simply absent)."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to drop by default
        """Drop connections; they reopen on the next call."""

    def reconnect(self) -> None:
        """Forget pooled connections after a fault so the next call opens fresh ones."""
        self.close()
