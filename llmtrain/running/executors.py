"""Where a registered run trains: here, in launched workers, or on Ray. Apart from ``local``
so the executors it dispatches to can import ``local`` without a cycle."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from llmtrain.config.args import TrainerConfig
from llmtrain.datalayer import Datalayer
from llmtrain.placement import Placement
from llmtrain.running.launchers import launch_workers
from llmtrain.running.local import run_here
from llmtrain.training.callbacks import Callback
from llmtrain.training.model import TrainedModel
from llmtrain.training.plan import RunPlan


def execution(config: TrainerConfig, placement: Placement) -> AbstractContextManager[None]:
    """Before registration: on Ray, the Ray session the fit runs in."""
    if config.ray_config is None or placement.launched:
        return contextlib.nullcontext()
    from llmtrain.running.ray.driver import ray_session

    return ray_session(config.ray_config)


def execute(
    plan: RunPlan, db: Datalayer, placement: Placement, *, callbacks: Sequence[Callback]
) -> TrainedModel | None:
    """Train ``plan``; its model (None on the ranks of a launched job other than 0)."""
    if plan.config.ray_config is not None and not placement.launched:
        from llmtrain.running.ray.driver import RayRun

        return RayRun(plan, db, callbacks).fit()
    if plan.config.launcher is not None and not placement.launched:
        return launch_workers(plan, db)
    with sigterm_as_interrupt(not placement.launched):  # a launched worker's are its launcher's
        return run_here(plan, db, placement, callbacks=callbacks)


@contextlib.contextmanager
def sigterm_as_interrupt(enabled: bool) -> Iterator[None]:
    """SIGTERM (a scheduler or ``kill`` stopping the fit) ends the run as Ctrl-C does, so it
    is recorded as interrupted with the steps it reached instead of staying "running"."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("terminated by SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
