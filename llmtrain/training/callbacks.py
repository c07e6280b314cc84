"""Callbacks: what a run tells an observer (a test, a tracker) after each step and at the end.

A callback is handed to ``FitRun(..., callbacks=[...])`` or registered for the whole process
(``register``, or the ``registered`` context), so ``LLMTrainer.fit`` runs pick it up
without new arguments. Launched workers are separate processes: they register the test
hooks their environment names once, at start (``install_from_environment``), never per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch

TRACE_ENV = "LLMTRAIN_TRACE_KEYS"  # a path: every step appends the keys it trained on
REPORT_ENV = "LLMTRAIN_RANK_REPORT"  # a path prefix: each rank reports what it held


class Callback:
    """No-op hooks; a callback overrides the ones it needs."""

    def on_train_begin(self, run: Any) -> None:
        """After setup, before the first step of this attempt (every rank)."""

    def on_log(self, run: Any, metrics: dict[str, float]) -> None:
        """Rank 0 only: ``metrics`` were recorded for step ``run.step`` (every
        ``logging_steps``, and ``eval_loss`` after each evaluation)."""

    def on_step(self, run: Any, keys: list[str]) -> None:
        """After optimizer step ``run.step``, which trained on the rows ``keys``."""

    def on_train_end(self, run: Any) -> None:
        """After the last step, before the final checkpoint (every rank)."""

    def on_cleanup(self, run: Any, failed: bool) -> None:
        """After the run, finished (``failed=False``) or not (every rank): release what the
        callback holds."""


_registered: list[Callback] = []


def registered_callbacks() -> list[Callback]:
    return list(_registered)


def register(callback: Callback) -> None:
    """Every later run of this process calls ``callback``."""
    _registered.append(callback)


@contextlib.contextmanager
def registered(*callbacks: Callback) -> Iterator[None]:
    """The runs started inside the block call ``callbacks``."""
    _registered.extend(callbacks)
    try:
        yield
    finally:
        for callback in callbacks:
            _registered.remove(callback)


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


class RankReport(Callback):
    """What each rank really was and held, so tests can prove distribution:
    ``{prefix}.rank{r}.json`` (placement, pid, strategy, optimizer-state size) and
    ``{prefix}.rank{r}.safetensors`` (its *local* trainable tensors: a shard under FSDP2 and
    ZeRO-3, the full tensor under DDP and ZeRO-1/2)."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = prefix

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


def install_from_environment() -> None:
    """Register the test hooks the environment names; called once when a worker starts."""
    if os.environ.get(TRACE_ENV):
        register(KeyTrace(os.environ[TRACE_ENV]))
    if os.environ.get(REPORT_ENV):
        register(RankReport(os.environ[REPORT_ENV]))
