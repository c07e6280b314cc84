"""Launchers: ``fit()`` on several processes (``torchrun`` or ``deepspeed``) from one call.

``LLMTrainer(..., launcher=Launcher(kind="torchrun", num_processes=2))`` then ``fit()``
stores the trainer and opens the run here, starts the workers, streams their output and
returns the trained model. Each worker reloads the trainer by name and version from the
metadata store and trains its shard of the rows.

The dependency runs one way: launchers call into ``llmtrain.training.launch``, which never
imports them.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain.errors import DistributedError
from llmtrain.launchers.command import build_command, free_port
from llmtrain.launchers.process import WorkerJob
from llmtrain.placement import Placement

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

__all__ = ["build_command", "execute", "free_port", "launch_workers"]


def execute(
    trainer: Any,
    db: Datalayer,
    run_id: str,
    placement: Placement,
    *,
    resume: bool | str,
    merge: bool,
) -> Any:
    """Train run ``run_id``: in worker processes when the trainer has a launcher and this
    process is not already one of its workers, else right here."""
    from llmtrain.training.launch import run_in_process
    from llmtrain.training.strategies import strategy_for

    if trainer.config.ray_config is not None and not placement.launched:
        from llmtrain.ray.driver import run_on_ray

        return run_on_ray(trainer, db, run_id, resume=resume, merge=merge)
    launcher = trainer.config.launcher
    if launcher is not None and launcher.kind != "python" and not placement.launched:
        return launch_workers(trainer, db, run_id, resume=resume, merge=merge)
    strategy = strategy_for(trainer.config, placement)
    # the launcher owns its workers' signals
    with nullcontext() if placement.launched else sigterm_as_interrupt():
        return run_in_process(trainer, db, run_id, strategy, resume=resume, merge=merge)


@contextmanager
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


def launch_workers(
    trainer: Any, db: Datalayer, run_id: str, *, resume: bool | str, merge: bool
) -> Any:
    """Train run ``run_id`` of the stored ``trainer`` in worker processes; return its model.

    On failure the run is marked failed with the first failing rank's error, every worker
    is gone, and DistributedError carries that error.
    """
    launcher = trainer.config.launcher
    job_dir = Path(tempfile.mkdtemp(prefix="llmtrain-job-"))
    try:
        command = build_command(
            launcher,
            db,
            job_dir,
            trainer_id=trainer.identifier,
            version=trainer.version or 0,
            run_id=run_id,
            resume=resume,
            merge=merge,
        )
        job = WorkerJob(command.argv, command.env, job_dir, timeout_s=launcher.timeout_s)
        try:
            job.run()
        except BaseException as exc:
            from llmtrain.training.launch import mark_failed

            mark_failed(db, run_id, exc)
            if isinstance(exc, DistributedError):
                exc.pids = job.pids()  # type: ignore[attr-defined]
            raise
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    model = db.load("model", trainer.identifier)
    if model.record.run_id != run_id:
        raise DistributedError(
            f"the workers finished, but the newest model "
            f"{trainer.identifier!r} comes from run {model.record.run_id}, "
            f"not {run_id}"
        )
    return model
