"""Callbacks: what a run tells an observer (a test, a tracker) after each step and at the end.

A callback is handed to ``FitRun(..., callbacks=[...])`` or registered for the whole process
(``register``, or the ``registered`` context), so ``LLMTrainer.fit`` runs pick it up
without new arguments. Launched workers are separate processes: they register the callbacks
their environment names once, at start (``install_from_environment``), never per step.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from typing import Any

#: comma-separated ``module:name`` of Callback classes or factories (called with no
#: arguments) that each launched worker imports and registers
CALLBACKS_ENV = "LLMTRAIN_CALLBACKS"


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


def install_from_environment() -> None:
    """Register the callbacks ``$LLMTRAIN_CALLBACKS`` names; called once when a worker starts,
    so a launched fit's ranks run an observer (a test's key trace) with no new arguments."""
    for spec in filter(None, os.environ.get(CALLBACKS_ENV, "").split(",")):
        module, _, name = spec.strip().partition(":")
        register(getattr(importlib.import_module(module), name)())
