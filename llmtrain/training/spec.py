"""What a trainer stores: its configuration and the data selection of its last fit()."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmtrain.queries import Query
from llmtrain.training.args import (
    DataArguments,
    DeepspeedConfig,
    FSDPConfig,
    LoraArguments,
    ModelArguments,
    TrainingArguments,
)


class DataSelection(BaseModel):
    """Which rows: ``X`` and ``Y`` name fields, ``select`` (and ``eval_select``) the rows."""

    model_config = ConfigDict(extra="forbid")

    X: str = Field(min_length=1)
    Y: str = Field(min_length=1)
    select: dict[str, Any]
    eval_select: dict[str, Any] | None = None


class FitSpec(DataSelection):
    """The data a fit() trained on: enough to replay it on the same (or another) database."""

    db: str = Field(description="The database URI, password redacted.")
    data_fingerprint: str | None = None

    def query(self) -> Query:
        return Query.from_dict(self.select)

    def eval_query(self) -> Query | None:
        return Query.from_dict(self.eval_select) if self.eval_select else None


class LauncherConfig(BaseModel):
    """How fit() starts its worker processes."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field("python", pattern="^(python|torchrun|deepspeed)$")
    num_processes: int = Field(1, ge=1)
    num_nodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, ge=1, le=65535)
    hostfile: str | None = None
    timeout_s: float | None = Field(None, gt=0)


class TrainerConfig(BaseModel):
    """Everything a trainer is; stored as JSON, validated on the way back."""

    model_config = ConfigDict(extra="forbid")

    identifier: str
    prompt_template: str | None = None
    model_args: ModelArguments
    lora_args: LoraArguments | None
    training_args: TrainingArguments
    data_args: DataArguments
    deepspeed_config: DeepspeedConfig | None = None
    fsdp_config: FSDPConfig | None = None
    launcher: LauncherConfig | None = None
    fit: FitSpec | None = None
