"""llmtrain: fine-tune LLMs (LoRA, QLoRA, DoRA) on rows streamed from SQL and MongoDB."""

from __future__ import annotations

import importlib
from typing import Any

from llmtrain.data import CachedQueryDataset, QueryDataLoader, QueryDataset
from llmtrain.datalayer import Datalayer, connect
from llmtrain.db.queries import (
    Collection,
    Conversations,
    Mix,
    Query,
    RawSQL,
    Table,
    mix,
    sql,
    sql_reward,
)
from llmtrain.errors import (
    BadRowError,
    CheckpointError,
    ConfigError,
    DataChangedError,
    DataError,
    LlmtrainError,
    QueryError,
    ServingWarning,
    StoreError,
)

__version__ = "0.1.0"

# The trainer pulls in transformers/peft: import it on first use, not with the package.
_LAZY = {
    "LLMTrainer": "llmtrain.running.trainer",
    "ModelArguments": "llmtrain.config.args",
    "LoraArguments": "llmtrain.config.args",
    "TrainingArguments": "llmtrain.config.args",
    "DataArguments": "llmtrain.config.args",
    "TrainedModel": "llmtrain.training.model",
    "DeepspeedConfig": "llmtrain.config.args",
    "FSDPConfig": "llmtrain.config.args",
    "Launcher": "llmtrain.config.args",
    "RayConfig": "llmtrain.config.args",
}

__all__ = [
    "BadRowError",
    "CachedQueryDataset",
    "CheckpointError",
    "Collection",
    "ConfigError",
    "Conversations",
    "DataChangedError",
    "DataError",
    "Datalayer",
    "LlmtrainError",
    "Mix",
    "Query",
    "QueryDataLoader",
    "QueryDataset",
    "QueryError",
    "RawSQL",
    "ServingWarning",
    "StoreError",
    "Table",
    "connect",
    "mix",
    "sql",
    "sql_reward",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmtrain' has no attribute {name!r}")
