"""What the layers below the Datalayer need of it, so they run the same on ``connect()``'s
Datalayer and on a Ray worker's view of the driver's (``llmtrain.running.ray.bridge.RemoteDB``)."""

from __future__ import annotations

from typing import Any, Protocol

from llmtrain.db.backend import DataBackend
from llmtrain.stores.artifacts.base import ArtifactStore
from llmtrain.stores.metadata.base import MetadataStore


class Database(Protocol):
    @property
    def uri(self) -> str:
        """The data URI, secrets redacted: the only form stored or shown."""

    @property
    def backend(self) -> DataBackend: ...

    @property
    def metadata(self) -> MetadataStore: ...

    @property
    def artifacts(self) -> ArtifactStore: ...


class Components(Database, Protocol):
    """A Database that also stores and loads components (a trained model's own handle)."""

    def add(self, component: Any) -> int: ...

    def load(
        self,
        type_id: str,
        identifier: str,
        version: int | None = None,
        *,
        checkpoint: str | int | None = None,
    ) -> Any: ...
