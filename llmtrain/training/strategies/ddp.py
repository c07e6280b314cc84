"""DistributedDataParallel: the model replicated, gradients averaged (NCCL, or gloo on CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from llmtrain.training.precision import Precision
from llmtrain.training.strategies.base import MakeOptimizer, ProcessGroupStrategy


class DDP(ProcessGroupStrategy):
    name = "ddp"

    def setup(
        self, model: Any, make_optimizer: MakeOptimizer, precision: Precision
    ) -> tuple[Any, Any]:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        return super().setup(wrapped, make_optimizer, precision)

    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        with contextlib.nullcontext() if sync else model.no_sync():
            yield

    def unwrap(self, model: Any) -> Any:
        return model.module
