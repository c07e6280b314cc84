"""The strategy: all that depends on the process count, so the loop never branches on it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.placement import Placement
from llmtrain.training.precision import Precision

MakeOptimizer = Callable[[list[torch.nn.Parameter]], Any]
_SCALER = "llmtrain_grad_scaler"  # its key in optimizer.pt


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def init_single_process_group(placement: Placement) -> None:
    """A one-process group (in-memory store, no port), so FSDP2/DeepSpeed also run unlaunched."""
    if dist.is_initialized() or placement.launched:
        return
    backend = "nccl" if placement.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class Strategy:
    """One process's part of the job at its ``placement``; the defaults are one process's."""

    name: str = "base"

    def __init__(self, placement: Placement | None = None) -> None:
        self.placement = placement if placement is not None else Placement.from_environment()
        self.scaler: Any = None  # a GradScaler when fp16 compute needs loss scaling
        self._params: list[torch.nn.Parameter] = []  # what optimizer_step clips

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def is_main(self) -> bool:
        return self.placement.is_main

    def launch(self) -> None:
        """Join the process group (if any), before the model is built."""

    def setup(
        self, model: Any, make_optimizer: MakeOptimizer, precision: Precision
    ) -> tuple[Any, Any]:
        """The model wrapped for this strategy and its optimizer over trainable params."""
        self.scaler = precision.grad_scaler()
        self._params = trainable_parameters(model)
        return model, make_optimizer(self._params)

    def teardown(self) -> None:
        """Leave the process group."""

    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        """Context for one micro-batch; gradients are synchronised only when ``sync``."""
        yield

    def backward(self, model: Any, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def optimizer_step(
        self, model: Any, optimizer: Any, max_grad_norm: float | None
    ) -> float | torch.Tensor:
        """Unscale (fp16), clip, step and zero the grads; return the gradient norm before
        clipping (left on the device: the loop reads it with the step's other numbers)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        # over DTensor shards (FSDP2) clip_grad_norm_ reduces them into the global norm
        norm = torch.nn.utils.clip_grad_norm_(self._params, max_grad_norm or math.inf)
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()

    # collectives on the placement's device (cuda with NCCL, else the CPU with gloo)
    def all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``value``."""
        if not self.placement.distributed:
            return value
        out = value.detach().to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(value.device)

    def all_gather(self, value: torch.Tensor) -> torch.Tensor:
        """Every rank's ``value`` stacked in rank order (``[world_size, *value.shape]``)."""
        if not self.placement.distributed:
            return value.unsqueeze(0)
        local = value.detach().to(self.device)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return torch.stack(out).to(value.device)

    def barrier(self) -> None:
        if self.placement.distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.placement.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.placement.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def unwrap(self, model: Any) -> Any:
        """The PEFT (or plain) model inside any wrapper."""
        return model

    def _named_state(self, model: Any) -> dict[str, Any]:
        """Adapter (PEFT key names) or full state of the model inside any wrapper."""
        from peft import PeftModel, get_peft_model_state_dict

        inner = self.unwrap(model)
        if isinstance(inner, PeftModel):
            return get_peft_model_state_dict(inner)
        return inner.state_dict()

    def trainable_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Full (gathered) tensors of the trainable weights, on the CPU, on rank 0."""
        return {k: v.detach().cpu().clone() for k, v in self._named_state(model).items()}

    def load_trainable_state_dict(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        from peft import PeftModel, set_peft_model_state_dict

        inner = self.unwrap(model)
        if isinstance(inner, PeftModel):
            set_peft_model_state_dict(inner, state)
        else:
            inner.load_state_dict(state)

    def save_optimizer(self, model: Any, optimizer: Any, folder: Path) -> None:
        """Write the optimizer state under ``folder`` (rank 0), with the loss scale."""
        state = self._optimizer_state(model, optimizer)
        if self.is_main:
            if self.scaler is not None:
                state = {**state, _SCALER: self.scaler.state_dict()}
            torch.save(state, folder / "optimizer.pt")

    def load_optimizer(self, model: Any, optimizer: Any, folder: Path) -> None:
        state = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
        scaler = state.pop(_SCALER, None)
        if scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler)
        self._load_optimizer_state(model, optimizer, state)

    def _optimizer_state(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """The full optimizer state (collective where it is sharded)."""
        return optimizer.state_dict()

    def _load_optimizer_state(self, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)


class ProcessGroupStrategy(Strategy):
    """Shared by every multi-process strategy: joining the group (unlaunched: a one-process one)."""

    def launch(self) -> None:
        init_single_process_group(self.placement)
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend, timeout=timedelta(minutes=30))
        self.placement = self.placement.joined(dist.get_rank(), dist.get_world_size())

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
