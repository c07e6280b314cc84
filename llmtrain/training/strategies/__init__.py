"""Strategies by name: how many processes train, and how the model is split between them."""

from __future__ import annotations

from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.placement import Placement
from llmtrain.training.strategies.base import Strategy


def make_strategy(name: str, placement: Placement | None = None, **options: Any) -> Strategy:
    """The strategy ``name`` at ``placement`` (default: the environment's, resolved now)."""
    if name == "single":
        from llmtrain.training.strategies.single import SingleProcess

        return SingleProcess(placement)
    if name == "ddp":
        from llmtrain.training.strategies.ddp import DDP

        return DDP(placement)
    if name == "fsdp":
        from llmtrain.training.strategies.fsdp import FSDP2

        return FSDP2(placement=placement, **options)
    if name == "deepspeed":
        from llmtrain.training.strategies.deepspeed import DeepSpeed

        return DeepSpeed(placement=placement, **options)
    raise ConfigError(f"unknown strategy {name!r}: use single, ddp, fsdp or deepspeed")


def strategy_for(config: Any, placement: Placement) -> Strategy:
    """DeepSpeed or FSDP when configured; DDP inside a multi-process launch; else single."""
    if config.deepspeed_config is not None:
        options = {"config": config.deepspeed_config, "training_args": config.training_args}
        return make_strategy("deepspeed", placement, **options)
    if config.fsdp_config is not None:
        return make_strategy("fsdp", placement, config=config.fsdp_config)
    return make_strategy("ddp" if placement.distributed else "single", placement)
