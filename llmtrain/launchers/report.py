"""Per-rank reports: what each process really was and held, so tests can prove distribution.

Written only when ``LLMTRAIN_RANK_REPORT`` names a path prefix: each rank writes
``{prefix}.rank{r}.json`` (rank, world size, pid, strategy, optimizer-state size) and
``{prefix}.rank{r}.safetensors`` (its *local* trainable tensors: a shard under FSDP2 and
ZeRO-3, the full tensor under DDP and ZeRO-1/2).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch

REPORT_ENV = "LLMTRAIN_RANK_REPORT"


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``param``: a DTensor's shard, ZeRO-3's partition, or itself."""
    if hasattr(param, "to_local"):
        param = param.to_local()
    elif getattr(param, "ds_tensor", None) is not None:
        param = param.ds_tensor
    return param.detach().to("cpu", copy=True).contiguous()


def optimizer_numel(optimizer: Any) -> int:
    """Elements of optimizer state held by this rank (partitioned under ZeRO and FSDP2)."""
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local_tensor(value).numel()
    return total


def write_rank_report(run: Any) -> None:
    prefix = os.environ.get(REPORT_ENV)
    if not prefix:
        return
    from safetensors.torch import save_file

    s = run.strategy
    inner = s.unwrap(run.model)
    tensors = {name: local_tensor(p) for name, p in inner.named_parameters() if p.requires_grad}
    save_file(tensors, f"{prefix}.rank{s.rank}.safetensors")
    report = {"rank": s.rank, "world_size": s.world_size, "local_rank": s.local_rank,
              "env_rank": os.environ.get("RANK"), "pid": os.getpid(),
              "host": socket.gethostname(), "strategy": s.name, "step": run.step,
              "optimizer_numel": optimizer_numel(run.optimizer),
              "shapes": {name: list(getattr(p, "ds_shape", p.shape))
                         for name, p in inner.named_parameters() if p.requires_grad}}
    with open(f"{prefix}.rank{s.rank}.json", "w") as fh:
        json.dump(report, fh)
