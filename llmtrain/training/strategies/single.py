"""One process, one device."""

from __future__ import annotations

from llmtrain.placement import Placement
from llmtrain.training.strategies.base import Strategy


class SingleProcess(Strategy):
    name = "single"

    def __init__(self, placement: Placement | None = None) -> None:
        # one process whatever the environment says: keep only its device
        local = (placement or Placement.from_environment()).local_rank
        super().__init__(Placement(local_rank=local))
