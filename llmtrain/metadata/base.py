"""The metadata store: components (versioned JSON records), runs, metrics and checkpoints.

Everything stored here is plain JSON that a pydantic model validates on the way back;
nothing is pickled, and URIs are redacted before they arrive.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from llmtrain.uri import redact_uri

RunStatus = Literal["created", "running", "completed", "failed"]
TABLE_PREFIX = "_llmtrain_"


class ComponentRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type_id: str
    identifier: str
    version: int
    created_at: datetime
    payload: dict[str, Any]


class RunRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    type_id: str
    identifier: str
    version: int
    status: RunStatus
    created_at: datetime
    updated_at: datetime
    info: dict[str, Any]
    error: str | None = None


class MetricRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    step: int
    values: dict[str, float]
    created_at: datetime


class CheckpointRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    step: int
    artifact_id: str
    created_at: datetime
    info: dict[str, Any]


class MetadataStore(ABC):
    """Versioned components plus the records of training runs.

    Versions start at 0 per (type_id, identifier) and are made unique by a unique index:
    concurrent adds retry on conflict instead of reading then writing. A store pickles as
    its URI and reconnects lazily; it only ever shows the URI redacted.
    """

    def __init__(self, uri: str) -> None:
        self._uri = uri
        self._where = redact_uri(uri)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._where!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"_uri": self._uri}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_uri"])  # type: ignore[misc]

    @abstractmethod
    def add_component(self, type_id: str, identifier: str, payload: dict[str, Any]) -> int:
        """Store a new version and return its number."""

    @abstractmethod
    def get_component(self, type_id: str, identifier: str,
                      version: int | None = None) -> ComponentRecord:
        """The given version, or the newest; ComponentNotFoundError if absent."""

    @abstractmethod
    def list_components(self, type_id: str | None = None,
                        identifier: str | None = None) -> list[ComponentRecord]:
        """All matching records, ordered by type_id, identifier, version."""

    @abstractmethod
    def remove_component(self, type_id: str, identifier: str, version: int | None = None) -> int:
        """Remove one version (or all when version is None); return how many went."""

    @abstractmethod
    def create_run(self, run_id: str, type_id: str, identifier: str, version: int,
                   info: dict[str, Any]) -> RunRecord: ...

    @abstractmethod
    def update_run(self, run_id: str, *, status: RunStatus | None = None,
                   info: dict[str, Any] | None = None, error: str | None = None) -> RunRecord:
        """Set status/error; ``info`` keys are merged into the stored info. Moving to
        ``running`` or ``completed`` without an error clears the stored one."""

    @abstractmethod
    def get_run(self, run_id: str) -> RunRecord: ...

    @abstractmethod
    def list_runs(self, type_id: str | None = None,
                  identifier: str | None = None) -> list[RunRecord]:
        """Oldest first."""

    @abstractmethod
    def log_metrics(self, run_id: str, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def get_metrics(self, run_id: str) -> list[MetricRecord]:
        """Ordered by step, then insertion."""

    @abstractmethod
    def add_checkpoint(self, run_id: str, step: int, artifact_id: str,
                       info: dict[str, Any]) -> CheckpointRecord: ...

    @abstractmethod
    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """Oldest step first."""

    @abstractmethod
    def remove_checkpoint(self, run_id: str, step: int) -> None: ...

    def close(self) -> None:
        """Release connections; the store reopens lazily if used again."""
