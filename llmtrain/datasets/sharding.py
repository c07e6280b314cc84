"""Where this process sits in the job: rank and world size."""

from __future__ import annotations

import os

from llmtrain.errors import ConfigError


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values win, then torch.distributed, then RANK/WORLD_SIZE, then (0, 1)."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            d_rank, d_world = dist.get_rank(), dist.get_world_size()
        else:
            d_rank = int(os.environ.get("RANK", 0))
            d_world = int(os.environ.get("WORLD_SIZE", 1))
        rank = d_rank if rank is None else rank
        world_size = d_world if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} / world_size {world_size} is not a valid placement")
    return rank, world_size
