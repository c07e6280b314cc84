"""This process's place in the job, resolved once: the only reader of RANK/WORLD_SIZE/LOCAL_RANK
(and GROUP_RANK, torchrun's node rank)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from llmtrain.errors import ConfigError, DistributedError


@dataclass(frozen=True)
class Placement:
    """``rank`` of ``world_size``, ``local_rank`` on its node. ``launched`` is decided once, here:
    DeepSpeed needs LOCAL_RANK even unlaunched, so a later look could take it for a worker."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by torchrun/deepspeed (every rank runs the script)
    node_rank: int = 0  # the node's index among the job's nodes (recorded with the run)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank} / world_size {self.world_size} is not a valid placement"
            )

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Placement:
        """A launcher's placement, else (0, 1); an initialised ``torch.distributed`` group wins."""
        env = os.environ if env is None else env
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        local, node = int(env.get("LOCAL_RANK", 0)), int(env.get("GROUP_RANK", 0))
        return cls(rank, world, local, "LOCAL_RANK" in env, node)

    @classmethod
    def resolve(cls, rank: int | None = None, world_size: int | None = None) -> Placement:
        """Explicit values win over the environment's (a dataset built for one rank)."""
        found = cls.from_environment()
        rank = found.rank if rank is None else rank
        world_size = found.world_size if world_size is None else world_size
        return replace(found, rank=rank, world_size=world_size)

    def joined(self, rank: int, world_size: int) -> Placement:
        """The placement inside the process group just joined; a launcher's must agree."""
        if self.launched and (rank, world_size) != (self.rank, self.world_size):
            raise DistributedError(
                f"the process group placed this process at rank {rank} of {world_size}, "
                f"its launcher at rank {self.rank} of {self.world_size}"
            )
        return replace(self, rank=rank, world_size=world_size)

    @property
    def in_launched_job(self) -> bool:
        return self.launched and self.distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")
