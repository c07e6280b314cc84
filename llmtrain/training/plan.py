"""A run's plan as registration decided it (in the run record): executors decide none of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.config.args import TrainerConfig, build
from llmtrain.config.spec import FitSpec
from llmtrain.data.snapshot import RunSnapshot
from llmtrain.stores.metadata.base import CheckpointRecord, RunRecord


@dataclass(frozen=True)
class RunPlan:
    run_id: str
    version: int  #: the trainer version (recipe) the run trains
    config: TrainerConfig  #: the recipe, with the fit's data in ``config.fit``
    snapshot: RunSnapshot  #: the keys of the rows it trains
    resume_from: CheckpointRecord | None = None  #: the checkpoint a resume continues from
    parent: dict[str, Any] | None = None  #: an incremental run's model it continues from
    callbacks: tuple[str, ...] = ()  #: ``module:Name`` callbacks every process builds
    eval_snapshot: RunSnapshot | None = None  #: the keys of fit(eval_select=)'s rows

    @property
    def identifier(self) -> str:
        return self.config.identifier

    @property
    def fit(self) -> FitSpec:
        assert self.config.fit is not None  # registration sets it
        return self.config.fit

    @classmethod
    def from_record(cls, run: RunRecord, resume_from: CheckpointRecord | None = None) -> RunPlan:
        info = run.info
        return cls(
            run.run_id,
            run.version,
            build(TrainerConfig, info["config"], f"run {run.run_id}"),
            RunSnapshot.from_record(info["snapshot"]),
            resume_from,
            info.get("parent"),
            tuple(info.get("callbacks") or ()),
            RunSnapshot.from_record(info["eval_snapshot"]) if info.get("eval_snapshot") else None,
        )


@dataclass(frozen=True)
class Done:
    """A fit with nothing to train: the completed run whose model answers it."""

    run_id: str
