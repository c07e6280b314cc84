"""The stored records and how any metadata backend encodes them: JSON in and out (never
pickle), UTC times, validated statuses and metric values, and the retry pause for racing
writers."""

from __future__ import annotations

import json
import random
import time
from datetime import datetime, timezone
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from llmtrain.errors import StoreError

UTC = timezone.utc
RunStatus = Literal["created", "running", "completed", "failed", "interrupted"]


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


#: concurrent writers retry a lost race this many times (each try is one short transaction)
MAX_TRIES = 50
_RUN_STATUSES = frozenset(get_args(RunStatus))


def now_utc() -> datetime:
    return datetime.now(UTC)


def dumps(value: Any, what: str) -> str:
    """JSON or a StoreError that says which value could not be stored."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{what} is not JSON-serialisable: {exc}") from None


def loads(value: Any, what: str) -> Any:
    """Stored JSON text back, or a StoreError: a value edited outside llmtrain (bytes, a
    pickle, another type) is refused, never decoded as anything but JSON."""
    if not isinstance(value, str):
        raise StoreError(
            f"{what} is not JSON text but {type(value).__name__}; was it edited outside llmtrain?"
        )
    try:
        return json.loads(value)
    except ValueError as exc:
        raise StoreError(
            f"{what} is not valid JSON ({exc}); was it edited outside llmtrain?"
        ) from None


def component_record(
    type_id: Any, identifier: Any, version: Any, created_at: Any, payload: Any
) -> ComponentRecord:
    """A stored component as read back; StoreError if any part of it is not what llmtrain
    writes (the payload must be a JSON object)."""
    what = f"stored component {type_id!r} {identifier!r} v{version!r}"
    data = loads(payload, f"{what}: its payload")
    try:
        return ComponentRecord(
            type_id=type_id,
            identifier=identifier,
            version=version,
            created_at=created_at,
            payload=data,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise StoreError(
            f"{what} is not a valid record ({problems}); was it edited outside llmtrain?"
        ) from None


def float_values(values: dict[str, Any]) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in values.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise StoreError(
            f"metric values must be a dict of numbers, got {values!r}: {exc}"
        ) from None


def check_status(status: str) -> None:
    if status not in _RUN_STATUSES:
        raise StoreError(
            f"run status {status!r} is invalid: use one of {', '.join(sorted(_RUN_STATUSES))}"
        )


def pause(attempt: int) -> None:
    """A short random sleep, so racing writers do not collide again in lockstep."""
    time.sleep(random.uniform(0.001, 0.005 * min(attempt + 1, 10)))
