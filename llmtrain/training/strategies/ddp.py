"""DistributedDataParallel: the model replicated, gradients averaged (NCCL, or gloo on CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from llmtrain.training.precision import Precision
from llmtrain.training.strategies.base import (
    MakeOptimizer,
    ProcessGroupStrategy,
    trainable_parameters,
)


class DDP(ProcessGroupStrategy):
    name = "ddp"

    def setup(
        self, model: Any, make_optimizer: MakeOptimizer, precision: Precision | None = None
    ) -> tuple[Any, Any]:
        from torch.nn.parallel import DistributedDataParallel

        self.scaler = precision.grad_scaler() if precision is not None else None
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        self._params = trainable_parameters(wrapped)
        return wrapped, make_optimizer(self._params)

    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        with contextlib.nullcontext() if sync else model.no_sync():
            yield

    def optimizer_step(
        self, model: Any, optimizer: Any, max_grad_norm: float | None
    ) -> torch.Tensor:
        return self.clip_and_step(self._params, optimizer, max_grad_norm)

    def unwrap(self, model: Any) -> Any:
        return model.module
