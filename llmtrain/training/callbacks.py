"""What a run tells an observer (a test, a tracker). ``fit(callbacks=[...])`` takes objects or
import paths ``"module:Name"`` (built with no arguments by every process: what workers can take)."""

from __future__ import annotations

import importlib
from typing import Any

from llmtrain.config.metrics import IMPORT_PATH
from llmtrain.errors import ConfigError


class Callback:
    """No-op hooks; a callback overrides the ones it needs."""

    def on_train_begin(self, run: Any) -> None:
        """After setup, before the first step of this attempt (every rank)."""

    def on_log(self, run: Any, metrics: dict[str, float]) -> None:
        """Rank 0 only: ``metrics`` were recorded for step ``run.step``."""

    def on_step(self, run: Any, keys: list[str]) -> None:
        """After optimizer step ``run.step``, which trained on the rows ``keys``."""

    def on_train_end(self, run: Any) -> None:
        """After the last step, before the final checkpoint (every rank)."""

    def on_cleanup(self, run: Any, failed: bool) -> None:
        """After the run, finished or ``failed`` (every rank): release what it holds."""


def callback_path(spec: str) -> str:
    """``spec`` if it is an import path ``module:Name``, else a ConfigError naming it."""
    if not IMPORT_PATH.match(spec):
        raise ConfigError(f"fit(callbacks=): {spec!r} is not an import path 'module:Name'")
    return spec


def build_callback(spec: str) -> Callback:
    """The callback an import path names, built with no arguments."""
    module, _, name = callback_path(spec).partition(":")
    try:
        return getattr(importlib.import_module(module), name)()
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"fit(callbacks=): cannot build {spec!r}: {exc}") from None
