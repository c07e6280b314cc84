"""``fit()`` on several processes (``launcher=``): workers read their plan from the run record."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from llmtrain.datalayer import Datalayer
from llmtrain.errors import DistributedError
from llmtrain.running.launchers.command import build_command, free_port
from llmtrain.running.launchers.process import WorkerJob
from llmtrain.running.local import mark_failed, model_of_run
from llmtrain.training.model import TrainedModel
from llmtrain.training.plan import RunPlan

__all__ = ["build_command", "free_port", "launch_workers"]


def launch_workers(plan: RunPlan, db: Datalayer) -> TrainedModel:
    """Train ``plan`` in worker processes; return its model. On failure every worker is gone
    and the first failing rank's error is recorded and raised."""
    launcher, run_id = plan.config.launcher, plan.run_id
    assert launcher is not None
    job_dir = Path(tempfile.mkdtemp(prefix="llmtrain-job-"))
    resume_from = plan.resume_from.artifact_id if plan.resume_from else None
    try:
        command = build_command(launcher, db, job_dir, run_id=run_id, resume_from=resume_from)
        job = WorkerJob(command.argv, command.env, job_dir, timeout_s=launcher.timeout_s)
        try:
            job.run()
        except BaseException as exc:
            mark_failed(db, run_id, exc)
            if isinstance(exc, DistributedError):
                exc.pids = job.pids()  # type: ignore[attr-defined]
            raise
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return model_of_run(db, run_id)
