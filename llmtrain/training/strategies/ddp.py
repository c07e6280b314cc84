"""DistributedDataParallel: the model replicated, gradients averaged (NCCL, or gloo on CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.training.strategies.base import Strategy
from llmtrain.training.strategies.single import clip_and_step, trainable_parameters

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class ProcessGroupStrategy(Strategy):
    """Shared by every multi-process strategy: joining the group and the collectives."""

    def launch(self) -> None:
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend, timeout=timedelta(minutes=30))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self.distributed:
            return value
        out = value.detach().clone().to(self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(out, op=_OPS[op])
        return out.to(value.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class DDP(ProcessGroupStrategy):
    name = "ddp"

    def setup(self, model: Any, make_optimizer: Callable[[list[torch.nn.Parameter]], Any]
              ) -> tuple[Any, Any]:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        self._params = trainable_parameters(wrapped)
        return wrapped, make_optimizer(self._params)

    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        with contextlib.nullcontext() if sync else model.no_sync():
            yield

    def optimizer_step(self, model: Any, optimizer: Any, max_grad_norm: float | None) -> float:
        return clip_and_step(self._params, optimizer, max_grad_norm)

    def unwrap(self, model: Any) -> Any:
        return model.module
