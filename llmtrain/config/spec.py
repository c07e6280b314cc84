"""The data a trainer fits on (written by ``fit()`` from its arguments, never an option)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmtrain.db.queries import MESSAGES, Query


class DataSelection(BaseModel):
    """Which rows: ``X`` and ``Y`` name fields, ``select`` (and ``eval_select``) the rows."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    X: str = Field(min_length=1)
    """The field rendered as the prompt ({X})."""
    Y: str | None = Field(default=None, min_length=1)
    """The field trained on as the response ({Y}); None: continued pre-training on X's text."""
    select: dict[str, Any]
    """The training rows: a stored query."""
    eval_select: dict[str, Any] | None = None
    """Evaluation rows; default: held-out rows (eval_fraction)."""

    @model_validator(mode="before")
    @classmethod
    def _conversations_field(cls, data: Any) -> Any:
        """Conversations come as one field of messages: X needs no naming."""
        if isinstance(data, dict) and data.get("X") is None:
            select = data.get("select")
            if isinstance(select, dict) and "conversations" in (select.get("kind"), *select):
                return {**data, "X": MESSAGES}
        return data

    @property
    def fields(self) -> list[str]:
        return [self.X] if self.Y is None else [self.X, self.Y]


class FitSpec(DataSelection):
    """The data a fit() trained on: enough to replay it on the same (or another) database."""

    db: str
    """The database URI, password redacted."""
    data_fingerprint: str | None = None
    """A hash of the selected keys, to notice changed rows on replay."""

    def query(self) -> Query:
        return Query.from_dict(self.select)

    def eval_query(self) -> Query | None:
        return Query.from_dict(self.eval_select) if self.eval_select else None
