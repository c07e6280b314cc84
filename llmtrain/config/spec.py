"""The data a trainer fits on (written by ``fit()`` from its arguments, never an option)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmtrain.db.queries import MESSAGES, Mix, Part, Query

#: the fields fit() takes, in the order rows carry them
ROLES = ("X", "Y", "chosen", "rejected", "label")


class DataSelection(BaseModel):
    """Which rows: ``X`` and ``Y`` name fields, ``select`` (and ``eval_select``) the rows."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    X: str = Field(min_length=1)
    """The field rendered as the prompt ({X})."""
    Y: str | None = Field(default=None, min_length=1)
    """The field trained on as the response ({Y}); None: continued pre-training on X's text."""
    chosen: str | None = Field(default=None, min_length=1)
    """Preference rows: the field of the answer the user preferred."""
    rejected: str | None = Field(default=None, min_length=1)
    """Preference rows: the field of the answer the user did not."""
    label: str | None = Field(default=None, min_length=1)
    """Feedback rows: the field saying whether the user liked Y (true/false or 1/0)."""
    reward: list[dict[str, Any]] | None = None
    """Rewards of sampled answers, stored as written: ``{"sql": ...}``, ``{"function": "m:f"}``."""
    select: dict[str, Any]
    """The training rows: a stored query."""
    eval_select: dict[str, Any] | None = None
    """Evaluation rows; default: held-out rows (eval_fraction)."""

    @model_validator(mode="before")
    @classmethod
    def _default_x(cls, data: Any) -> Any:
        select = data.get("select") if isinstance(data, dict) else None
        if isinstance(select, dict) and data.get("X") is None and (x := default_x(select)):
            return {**data, "X": x}
        return data

    @property
    def pairs(self) -> tuple[str, str] | None:
        """Preference rows: the (chosen, rejected) fields; None for responses or documents."""
        return (self.chosen, self.rejected) if self.chosen and self.rejected else None

    @property
    def roles(self) -> list[str]:
        """The fit() fields given, in the order rows carry them (the objective says which)."""
        return [role for role in ROLES if getattr(self, role)]

    @property
    def fields(self) -> list[str]:
        return [getattr(self, role) for role in self.roles]


def default_x(select: dict[str, Any]) -> str | None:
    """X needs no naming for conversations (one field of messages), nor for a mixture whose
    every source names its own (the first one's is recorded); None: it does."""
    if x := _conversations_x(select):
        return x
    parts = select.get("parts") or select.get("mix")
    if isinstance(parts, list) and parts and all(isinstance(p, dict) for p in parts):
        named = [p.get("X") or _conversations_x(p.get("select", p)) for p in parts]
        return named[0] if all(named) else None
    return None


def _conversations_x(select: Any) -> str | None:
    conversations = isinstance(select, dict) and "conversations" in (select.get("kind"), *select)
    return MESSAGES if conversations else None


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

    def sources(self) -> list[tuple[Query, list[tuple[str, str]]]]:
        """Each source read (a mixture's each, the eval rows') with its (role, field) pairs."""
        evaluated = [Part(q) for q in filter(None, [self.eval_query()])]
        return [
            (p.select, list(zip(self.roles, p.fields_or(self.fields))))
            for p in [*self.parts(), *evaluated]
        ]

    def parts(self) -> tuple[Part, ...]:
        """The training sources: a mixture's, or the one selection."""
        query = self.query()
        return query.parts if isinstance(query, Mix) else (Part(query),)
