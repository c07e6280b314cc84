"""A training objective: the fit() fields it takes, its configuration rules, the check of its
rows, its collate and its loss, in one registered module. The loop, the reader, the snapshot
and the records ask the objective, never its name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from llmtrain.data.rows import RowCheck
from llmtrain.db.keys import key_repr
from llmtrain.formatting import Example, Formatter, PackedCollator


class Loss(Protocol):
    """The batch's summed loss (the loop divides by the step's ``num_target_tokens``), and
    the metrics besides it since the last ``logged()`` (rewards, margins)."""

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor: ...
    def logged(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Batching:
    """What a collate is made of: a formatter a source (a mixture's several), the fit's fields,
    and ``token_budget``: a step's rows handed over at once, packed into micro-batches."""

    formatters: Sequence[Formatter]
    pad_id: int
    source: str
    packer: PackedCollator | None
    fields: Sequence[str] = ()
    token_budget: int | None = None
    batch_size: int = 1
    settings: Any = None  # objective_args: what the objective's own batches need (GRPO's room)


class Settings(BaseModel):
    """An objective's own fields of ``objective_args`` (flat keywords of LLMTrainer too)."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        use_attribute_docstrings=True,
    )


class Objective(ABC):
    """What one objective trains; subclasses set the class attributes and their rules."""

    name: ClassVar[str]
    #: the fit() fields it trains, in the order its rows carry them (``optional``: may be left)
    roles: ClassVar[tuple[str, ...]]
    optional: ClassVar[tuple[str, ...]] = ()
    #: what rows of these fields hold, in the message that suggests this objective
    trains: ClassVar[str]
    #: trains against a frozen reference (the starting model: the adapter off, or its parent's)
    reference: ClassVar[bool] = False
    #: samples its answers from the policy (the template's {Y} is what it generates)
    generated: ClassVar[bool] = False
    #: the metrics its progress shows after the loss
    shown: ClassVar[tuple[str, ...]] = ()
    #: its own settings (fields of objective_args, recorded and replayed), if any
    settings: ClassVar[type[Settings] | None] = None
    #: the loss_type values it takes, its default first
    loss_types: ClassVar[tuple[str, ...]] = ()

    def takes(self, roles: Sequence[str]) -> bool:
        return set(self.roles) - set(self.optional) <= set(roles) <= set(self.roles)

    def row_check(self) -> RowCheck | None:
        """How the reader checks a row (None: its own: text fields, or a conversation)."""
        return None

    def method(self) -> str:
        """What ``show`` prints before the adapter."""
        return self.name.upper()

    def problems(self, config: Any) -> list[str]:
        """This objective's contradictions in ``config`` (a TrainerConfig) beyond its fields."""
        return []

    def prepare(self, db: Any, config: Any, snapshot: Any) -> Any:
        """The config the run records, completed from its snapshot (as given by default)."""
        return config

    @abstractmethod
    def collate(self, how: Batching) -> Callable[[list[tuple[Any, dict[str, Any]]]], Any]:
        """Rows to this objective's batches (a step's micro-batches with a token budget)."""

    @abstractmethod
    def loss(self, run: Any) -> Loss:
        """The loss of a run (a FitRun: its ``base_model``, ``config``, ``db``, ``plan``)."""


def counted(batch: dict[str, Any], examples: Sequence[Example]) -> dict[str, Any]:
    """The batch with its host-side counts as plain ints, made here: each ``int(tensor)`` in
    the loop released the GIL to the batch thread (measured: data wait 5-6% of a step -> 0.4%)."""
    batch["num_target_tokens"] = int(batch["num_target_tokens"])
    batch["num_tokens"] = sum(len(e) for e in examples)
    batch["keys"] = list(dict.fromkeys(key_repr(e.key) for e in examples))  # a row's windows
    return batch


class Averaged:
    """Metrics added up until :meth:`logged`, each the mean over the rows it was measured on."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float | torch.Tensor]] = {}

    def add(self, metrics: dict[str, torch.Tensor], rows: int, weights: dict[str, int]) -> None:
        """``metrics`` of ``rows`` rows (``weights``: by the name's last part, where fewer)."""
        for name, value in metrics.items():
            if weight := weights.get(name.rsplit("/", 1)[-1], rows):
                total = self.sums.setdefault(name, [0.0, 0])
                total[0] = total[0] + value.detach().float() * weight
                total[1] = total[1] + weight

    def logged(self) -> dict[str, float]:
        """The mean of each metric since the last call (reads the device)."""
        sums, self.sums = self.sums, {}
        return {name: float(total) / max(float(rows), 1) for name, (total, rows) in sums.items()}
