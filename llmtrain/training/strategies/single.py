"""One process, one device."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.placement import Placement
from llmtrain.training.precision import Precision
from llmtrain.training.strategies.base import MakeOptimizer, Strategy, trainable_parameters


class SingleProcess(Strategy):
    name = "single"

    def __init__(self, placement: Placement | None = None) -> None:
        # one process whatever the environment says: keep only its device
        local = (placement or Placement.from_environment()).local_rank
        super().__init__(Placement(local_rank=local))

    def setup(
        self, model: Any, make_optimizer: MakeOptimizer, precision: Precision | None = None
    ) -> tuple[Any, Any]:
        self.scaler = precision.grad_scaler() if precision is not None else None
        self._params = trainable_parameters(model)
        return model, make_optimizer(self._params)

    def optimizer_step(
        self, model: Any, optimizer: Any, max_grad_norm: float | None
    ) -> torch.Tensor:
        return self.clip_and_step(self._params, optimizer, max_grad_norm)
