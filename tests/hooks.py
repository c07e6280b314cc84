"""Callbacks of the tests: the key trace, and what launched workers build from the import
paths a test passes (``fit(callbacks=["hooks:key_trace", "hooks:RankReport"])``, with this
folder on ``PYTHONPATH``), writing where the variables below say."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch

from llmtrain.training.callbacks import Callback

TRACE_ENV = "LLMTRAIN_TRACE_KEYS"  # a path: every step appends the keys it trained on
REPORT_ENV = "LLMTRAIN_RANK_REPORT"  # a path prefix: each rank reports what it held


class KeyTrace(Callback):
    """The row keys of every step: in ``steps``, and in ``{path}.rank{r}`` when a path is
    given (one JSON line per step, fsynced: a process killed right after still shows it)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = path
        self.steps: list[dict[str, Any]] = []

    def on_step(self, run: Any, keys: list[str]) -> None:
        entry = {"step": run.step, "keys": keys}
        self.steps.append(entry)
        if self.path is not None:
            with open(f"{self.path}.rank{run.strategy.rank}", "a") as fh:
                fh.write(json.dumps(entry) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    @property
    def keys(self) -> list[str]:
        return [k for entry in self.steps for k in entry["keys"]]


def crash_after_checkpoint(monkeypatch: Any, step: int) -> Any:
    """Make runs raise KeyboardInterrupt right after their checkpoint at ``step`` is saved and
    recorded (as a kill there would leave them); returns the undo."""
    from llmtrain.training import run as run_module

    original = run_module.FitRun.save_checkpoint

    def crash(self: Any) -> Any:
        record = original(self)
        if self.step == step:
            raise KeyboardInterrupt("simulated crash")
        return record

    monkeypatch.setattr(run_module.FitRun, "save_checkpoint", crash)
    return lambda: monkeypatch.setattr(run_module.FitRun, "save_checkpoint", original)


def key_trace() -> KeyTrace:
    """Built by each launched worker (``fit(callbacks=["hooks:key_trace"])``), which builds its
    callbacks only once the database URIs are out of its environment: code it imports, and
    what that code starts, never sees the secrets."""
    from llmtrain.running.launchers.command import DB_ENV, METADATA_ENV

    leaked = [name for name in (DB_ENV, METADATA_ENV) if name in os.environ]
    if leaked:
        raise RuntimeError(f"callbacks were installed with {leaked} still in the environment")
    return KeyTrace(os.environ[TRACE_ENV])


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``param``: a DTensor's shard, ZeRO-3's partition, or itself."""
    partition = getattr(param, "ds_tensor", None)
    if hasattr(param, "to_local"):
        param = param.to_local()
    elif partition is not None:
        param = partition
    return param.detach().to("cpu", copy=True).contiguous()


def optimizer_numel(optimizer: Any) -> int:
    """Elements of optimizer state held by this rank (partitioned under ZeRO and FSDP2)."""
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local_tensor(value).numel()
    return total


class ResumeReport(Callback):
    """Where each rank's attempt started, after its setup restored any checkpoint:
    ``{prefix}.rank{r}.json`` with the loop's step and the optimizer's own step counters
    (a sharded optimizer state restored from the checkpoint counts its steps on)."""

    def __init__(self) -> None:
        self.prefix = os.environ[REPORT_ENV]

    def on_train_begin(self, run: Any) -> None:
        counters = {
            float(state["step"])
            for state in run.optimizer.state.values()
            if isinstance(state, dict) and "step" in state
        }
        report = {"rank": run.strategy.rank, "step": run.step, "optimizer_steps": sorted(counters)}
        with open(f"{self.prefix}.rank{run.strategy.rank}.json", "w") as fh:
            json.dump(report, fh)


class RankReport(Callback):
    """What each rank really was and held, so tests can prove distribution:
    ``{prefix}.rank{r}.json`` (placement, pid, strategy, optimizer-state size) and
    ``{prefix}.rank{r}.safetensors`` (its *local* trainable tensors: a shard under FSDP2 and
    ZeRO-3, the full tensor under DDP and ZeRO-1/2); ``prefix`` defaults to $REPORT_ENV."""

    def __init__(self, prefix: str | os.PathLike[str] | None = None) -> None:
        self.prefix = os.environ[REPORT_ENV] if prefix is None else prefix

    def on_train_end(self, run: Any) -> None:
        from safetensors.torch import save_file

        s = run.strategy
        inner = s.unwrap(run.model)
        trainable = [(name, p) for name, p in inner.named_parameters() if p.requires_grad]
        save_file(
            {name: local_tensor(p) for name, p in trainable},
            f"{self.prefix}.rank{s.rank}.safetensors",
        )
        report = {
            "rank": s.rank,
            "world_size": s.world_size,
            "local_rank": s.placement.local_rank,
            "launched": s.placement.launched,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "strategy": s.name,
            "step": run.step,
            "optimizer_numel": optimizer_numel(run.optimizer),
            "shapes": {name: list(getattr(p, "ds_shape", p.shape)) for name, p in trainable},
        }
        with open(f"{self.prefix}.rank{s.rank}.json", "w") as fh:
            json.dump(report, fh)
