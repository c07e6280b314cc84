"""One process, one device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmtrain.training.strategies.base import Strategy


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def clip_and_step(params: list[torch.nn.Parameter], optimizer: Any,
                  max_grad_norm: float | None) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


class SingleProcess(Strategy):
    name = "single"

    def __init__(self) -> None:
        super().__init__()
        self.rank, self.world_size = 0, 1

    def setup(self, model: Any, make_optimizer: Callable[[list[torch.nn.Parameter]], Any]
              ) -> tuple[Any, Any]:
        self._params = trainable_parameters(model)
        return model, make_optimizer(self._params)

    def optimizer_step(self, model: Any, optimizer: Any, max_grad_norm: float | None) -> float:
        return clip_and_step(self._params, optimizer, max_grad_norm)
