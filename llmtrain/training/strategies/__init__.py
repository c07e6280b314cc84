"""Strategies by name: how many processes train, and how the model is split between them."""

from __future__ import annotations

from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.training.strategies.base import Strategy

__all__ = ["Strategy", "make_strategy"]


def make_strategy(name: str, **options: Any) -> Strategy:
    if name == "single":
        from llmtrain.training.strategies.single import SingleProcess

        return SingleProcess()
    if name == "ddp":
        from llmtrain.training.strategies.ddp import DDP

        return DDP()
    if name == "fsdp":
        from llmtrain.training.strategies.fsdp import FSDP2

        return FSDP2(**options)
    if name == "deepspeed":
        from llmtrain.training.strategies.deepspeed import DeepSpeed

        return DeepSpeed(**options)
    raise ConfigError(f"unknown strategy {name!r}: use single, ddp, fsdp or deepspeed")
