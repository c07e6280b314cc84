"""Strategies by name: how many processes train, and how the model is split between them."""

from __future__ import annotations

import importlib
from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.placement import Placement
from llmtrain.training.strategies.base import Strategy

#: name -> class in the module of that name, imported on use (FSDP2 and DeepSpeed are heavy)
_CLASSES = {"single": "SingleProcess", "ddp": "DDP", "fsdp": "FSDP2", "deepspeed": "DeepSpeed"}


def make_strategy(name: str, placement: Placement | None = None, **options: Any) -> Strategy:
    """The strategy ``name`` at ``placement`` (default: the environment's, resolved now)."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown strategy {name!r}: use single, ddp, fsdp or deepspeed")
    module = importlib.import_module(f"llmtrain.training.strategies.{name}")
    strategy: type[Strategy] = getattr(module, _CLASSES[name])
    return strategy(placement=placement, **options)


def strategy_for(config: Any, placement: Placement) -> Strategy:
    """DeepSpeed or FSDP when configured; DDP inside a multi-process launch; else single."""
    if config.deepspeed_config is not None:
        options = {"config": config.deepspeed_config, "training_args": config.training_args}
        return make_strategy("deepspeed", placement, **options)
    if config.fsdp_config is not None:
        return make_strategy("fsdp", placement, config=config.fsdp_config)
    return make_strategy("ddp" if placement.distributed else "single", placement)
