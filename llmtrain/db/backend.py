"""Keyset reads (``key >= lower ORDER BY key LIMIT n``): no open cursor for a slow reader to pin."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from llmtrain.db.keys import Key, KeyPage, check_keys, same_key
from llmtrain.db.queries import TURNS, Conversations, Query
from llmtrain.db.retry import RetryPolicy
from llmtrain.db.sources import Source
from llmtrain.errors import DatabaseUnavailableError
from llmtrain.uri import redact_uri

Row = dict[str, Any]
KeyedRows = list[tuple[Key, Row]]  # (key, {field: value}) pairs
Fields = Sequence[str]  # the fields (columns) to read
T = TypeVar("T")
log = logging.getLogger("llmtrain.db")
_IN_CHUNK = 1000  # keys a statement of fetch_by_keys
NO_KEY = object()  # no key before the first page


def keyset(
    fetch: Callable[[Any, int], Sequence[Any]], page_size: int
) -> Iterator[tuple[Sequence[Any], Any]]:
    """(rows, key before them) pages of ``fetch``; each starts *at* the last key: repeats show."""
    lower: Any = NO_KEY
    while True:
        limit = page_size if lower is NO_KEY else page_size + 1
        page = fetch(lower, limit)
        yield (page[1:] if page and same_key(page[0][0], lower) else page), lower
        if len(page) < limit:
            return
        lower = page[-1][0]


class DataBackend(ABC):
    """Reads rows of a query in key order. Implementations must be safe to pickle."""

    def __init__(self, uri: str, *, retry: RetryPolicy | None = None) -> None:
        self._uri = uri
        self.uri = redact_uri(uri)  # safe to show and store
        self.retry = retry or RetryPolicy()

    @abstractmethod
    def key_name(self, query: Query) -> str:
        """The column/field the query is paged on; QueryError if there is no usable one."""

    def fetch_rows(self, query: Query, fields: Fields, lower: Key | None, limit: int) -> KeyedRows:
        """Up to ``limit`` (key, {field: value}) from ``lower`` on, key order; absent fields out."""
        if isinstance(query, Conversations) and tuple(fields) != (TURNS,):
            keys = [key for key, _ in self._page(query, (TURNS,), lower, limit)]
            return self.fetch_by_keys(query, fields, keys)
        return self._page(query, fields, lower, limit)

    @abstractmethod
    def _page(self, query: Query, fields: Fields, lower: Key | None, limit: int) -> KeyedRows:
        """:meth:`fetch_rows`, for conversations only their keys and last turns."""

    def fetch_by_keys(self, query: Query, fields: Fields, keys: Sequence[Key]) -> KeyedRows:
        """The rows with exactly these keys (any order; missing keys are simply absent)."""
        chunks = (list(keys[i : i + _IN_CHUNK]) for i in range(0, len(keys), _IN_CHUNK))
        return [row for chunk in chunks for row in self._by_keys(query, fields, chunk)]

    @abstractmethod
    def _by_keys(self, query: Query, fields: Fields, keys: list[Key]) -> KeyedRows: ...

    @abstractmethod
    def resolve(self, source: Query | str) -> Source:
        """The table or collection (a name, or a query's source) as the database names it."""

    @abstractmethod
    def reads(self, query: Query) -> list[str] | None:
        """The base tables (``schema.table``) it reads, views expanded; None: it does not parse."""

    @abstractmethod
    def derived_keys(self, query: Query, source: Source, keys: Sequence[Key]) -> list[Key]:
        """The selection's keys of the rows it derives from rows ``keys`` of ``source``."""

    @abstractmethod
    def forget_keys(self, source: Source, keys: Sequence[Key]) -> list[tuple[int, Key]]:
        """Have the database leave ``keys`` out; (position, row's own key) of those it matched."""

    def row_keys(self, source: Source, key: Key) -> list[Key]:
        """Keys of the rows the database takes ``key`` for (``k5`` for ``K5``, a padded char(n))."""
        return [key]

    def pages(self, query: Query, fields: Fields, page_size: int) -> Iterator[KeyedRows]:
        """The selection's rows in key order, ``page_size`` a statement, keys checked."""

        def fetch(lower: Any, limit: int) -> KeyedRows:
            return self.fetch_rows(query, fields, None if lower is NO_KEY else lower, limit)

        for rows, lower in keyset(fetch, page_size):
            check_keys([k for k, _ in rows], lower, self.key_name(query), query.source)
            yield list(rows)

    def key_pages(
        self, query: Query, version_column: str | None, page_size: int
    ) -> Iterator[KeyPage]:
        """The selection's keys (and each one's version) in key order, as :meth:`pages`."""
        fields = (version_column,) if version_column else ()
        for rows in self.pages(query, fields, page_size):
            versions = [r.get(version_column) for _, r in rows] if version_column else None
            yield KeyPage([k for k, _ in rows], versions)

    def close(self) -> None:
        """Drop connections; they reopen on the next call."""

    def reconnect(self) -> None:
        """Forget pooled connections after a fault so the next call opens fresh ones."""
        self.close()

    def _with_retry(
        self,
        what: str,
        call: Callable[[], T],
        transient: tuple[type[BaseException], ...],
        permanent: Callable[[BaseException], bool] = lambda exc: False,
    ) -> T:
        """One idempotent statement, retried (reconnecting) on a transient, not permanent, fault."""
        for delay in [*self.retry.delays(), None]:  # None: the last attempt
            try:
                return call()
            except transient as exc:
                if permanent(exc):
                    raise
                problem = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                if delay is None:
                    raise DatabaseUnavailableError(
                        f"{what} on {self.uri} failed after {self.retry.attempts} attempts: "
                        f"{problem}"
                    ) from exc
                log.warning(
                    "%s on %s failed (%s); retrying in %.1fs", what, self.uri, problem, delay
                )
                self.reconnect()
                time.sleep(delay)
        raise AssertionError("unreachable")
