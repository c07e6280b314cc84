"""The strategy: everything the loop needs that depends on how many processes train.

The loop calls these few methods and never branches on the strategy, so single process,
DDP, FSDP2 and DeepSpeed are swapped without touching it.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


class Strategy(ABC):
    name: str = "base"

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- lifecycle -------------------------------------------------------------------------
    def launch(self) -> None:
        """Join the process group (if any). Called once, before the model is built."""

    @abstractmethod
    def setup(self, model: Any, make_optimizer: Callable[[list[torch.nn.Parameter]], Any]
              ) -> tuple[Any, Any]:
        """Wrap the model for this strategy and build its optimizer over trainable params."""

    def teardown(self) -> None:
        """Leave the process group."""

    # -- the step --------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        """Context for one micro-batch; gradients are synchronised only when ``sync``."""
        yield

    def backward(self, model: Any, loss: torch.Tensor) -> None:
        loss.backward()

    @abstractmethod
    def optimizer_step(self, model: Any, optimizer: Any, max_grad_norm: float | None) -> float:
        """Clip, step and zero the gradients; return the gradient norm before clipping."""

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return value

    def barrier(self) -> None:
        """Wait for every rank."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    # -- state -----------------------------------------------------------------------------
    def unwrap(self, model: Any) -> Any:
        """The PEFT (or plain) model inside any wrapper."""
        return model

    def trainable_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Full (gathered) tensors of the trainable weights, on the CPU, on rank 0."""
        from peft import PeftModel, get_peft_model_state_dict

        inner = self.unwrap(model)
        if isinstance(inner, PeftModel):
            state = get_peft_model_state_dict(inner)
            return {k: v.detach().cpu().clone() for k, v in state.items()}
        return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}

    def save_optimizer(self, model: Any, optimizer: Any, folder: Path) -> None:
        """Write the optimizer state under ``folder`` (rank 0 for replicated optimizers)."""
        if self.is_main:
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")

    def load_optimizer(self, model: Any, optimizer: Any, folder: Path) -> None:
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True,
                                             map_location="cpu"))

    def load_trainable_state_dict(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        from peft import PeftModel, set_peft_model_state_dict

        inner = self.unwrap(model)
        if isinstance(inner, PeftModel):
            set_peft_model_state_dict(inner, state)
        else:
            inner.load_state_dict(state)
