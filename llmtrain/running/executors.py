"""Where a registered run trains: in this process, in launched worker processes, or on Ray.

``execution(config, placement)`` holds what an executor needs before anything is recorded
(a Ray cluster, joined and checked); ``execute(plan, ...)`` trains the plan there. Every
executor runs the same body (:func:`llmtrain.running.local.train_run`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from llmtrain.config.args import TrainerConfig
from llmtrain.placement import Placement
from llmtrain.running.local import run_here
from llmtrain.training.callbacks import Callback
from llmtrain.training.model import TrainedModel
from llmtrain.training.plan import RunPlan

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer


def _on_ray(config: TrainerConfig, placement: Placement) -> bool:
    return config.ray_config is not None and not placement.launched


def _launches(config: TrainerConfig, placement: Placement) -> bool:
    launcher = config.launcher
    return launcher is not None and not placement.launched


@contextlib.contextmanager
def execution(config: TrainerConfig, placement: Placement) -> Iterator[None]:
    """Before registration: on Ray, this process's Ray instance (or one started for the fit
    and shut down after it), with the workers' resources checked."""
    if not _on_ray(config, placement):
        yield
        return
    from llmtrain.running.ray.driver import ray_session

    assert config.ray_config is not None
    with ray_session(config.ray_config):
        yield


def execute(
    plan: RunPlan,
    db: Datalayer,
    placement: Placement,
    *,
    callbacks: Sequence[Callback],
    merge: bool,
) -> TrainedModel | None:
    """Train ``plan`` on Ray, in launched workers, or here; returns its model (None on the
    ranks of a launched job other than 0)."""
    if _on_ray(plan.config, placement):
        from llmtrain.running.ray.driver import RayRun

        return RayRun(plan, db, callbacks).fit(merge=merge)
    if _launches(plan.config, placement):
        from llmtrain.running.launchers import launch_workers

        return launch_workers(plan, db, merge=merge)
    # a launched worker's signals are its launcher's
    with contextlib.nullcontext() if placement.launched else sigterm_as_interrupt():
        return run_here(plan, db, placement, callbacks=callbacks, merge=merge)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler or ``kill`` stopping the fit) ends the run as Ctrl-C does, so it
    is recorded as interrupted with the steps it reached instead of staying "running"."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("terminated by SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
