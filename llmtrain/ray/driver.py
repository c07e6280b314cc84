"""The driver of a Ray fit: start Ray Train's TorchTrainer, serve its workers, record.

The driver (the process that called fit()) keeps the database: it stored the trainer and
opened the run before, it answers the workers' calls while they train, it copies every
checkpoint they report from Ray's storage into the artifact store, and at the end it stores
the model and marks the run, as :func:`llmtrain.training.launch.run_in_process` does.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from llmtrain.artifacts.fsspec_store import check_url
from llmtrain.console import QUIET_ENV
from llmtrain.errors import ConfigError, DistributedError
from llmtrain.ray.bridge import DriverService
from llmtrain.ray.worker import checkpoint_name, train_loop
from llmtrain.training.args import RayConfig
from llmtrain.training.callbacks import registered_callbacks
from llmtrain.training.checkpoint import Checkpointer, verify
from llmtrain.uri import redact_uri

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer


def storage_location(storage: str | None) -> tuple[str, Any]:
    """(path for Ray, pyarrow filesystem or None): a folder (absolute), or any fsspec URL
    (``s3://``, ``gs://``, ...) through fsspec, as the artifact store reaches it: the same
    credentials from the environment, handed to Ray as a pyarrow filesystem."""
    if storage is None or "://" not in storage or storage.startswith("file://"):
        folder = (storage or "~/ray_results").removeprefix("file://")
        return str(Path(folder).expanduser().absolute()), None
    import pyarrow.fs  # type: ignore[import-untyped]
    from fsspec.core import url_to_fs

    check_url(storage, "ray_config.storage")
    filesystem, path = url_to_fs(storage, use_listings_cache=False)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(filesystem))


class RayRun:
    """One attempt at training run ``run_id`` on Ray (a resume is another attempt)."""

    def __init__(self, trainer: Any, db: Datalayer, run_id: str, *, resume: bool | str) -> None:
        self.trainer, self.db, self.run_id, self.resume = trainer, db, run_id, resume
        self.config: RayConfig = trainer.config.ray_config
        self.name = f"llmtrain-{run_id[:12]}-{uuid.uuid4().hex[:8]}"
        self.path, self.filesystem = storage_location(self.config.storage)
        self.finished: dict[str, Any] | None = None
        self.checkpoints: list[str] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="llmtrain-ray-"))
        keep = trainer.config.training_args.save_total_limit
        self.checkpointer = Checkpointer(db, run_id, None, keep=keep, workdir=self.workdir)  # type: ignore[arg-type]

    # -- what the workers get ----------------------------------------------------------------
    def loop_config(self, broker: Any) -> dict[str, Any]:
        """Everything a worker needs, and nothing that locates the database: the recipe
        without the fit's database URI, the snapshot manifest, the channel."""
        recipe = self.trainer.to_dict()
        recipe["fit"] = {**recipe["fit"], "db": "ray-driver://"}  # not where the rows are
        return {
            "broker": broker,
            "trainer": recipe,
            "version": self.trainer.version,
            "snapshot": self.trainer.data_snapshot.to_record(),
            "run_id": self.run_id,
            "resume": self.resume,
            "callbacks": registered_callbacks(),
            "quiet": os.environ.get(QUIET_ENV) == "1",  # as quiet as the fit on the driver
        }

    # -- what the driver answers ---------------------------------------------------------------
    def database(self) -> str | None:
        return self.db.secret_uri() if self.config.workers_read_database else None

    def resume_point(self) -> bool | str:
        """What the worker group resumes from: the fit's ``resume=`` the first time, the
        newest checkpoint once this attempt recorded one (Ray restarted the group)."""
        return True if self.checkpoints else self.resume

    def record_checkpoint(self, step: int, epoch: int, world_size: int) -> Any:
        """Copy the checkpoint the workers reported from Ray's storage into the artifact
        store and record it on the run, as a local run's is."""
        name = checkpoint_name(step)
        source = ray.train.Checkpoint(f"{self.path}/{self.name}/{name}", self.filesystem)
        folder = self.workdir / name
        try:
            source.to_directory(str(folder))
            verify(folder)
            record = self.checkpointer.record(
                folder, {"step": step, "epoch": epoch, "world_size": world_size}
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.checkpoints.append(name)
        return record

    def finish(self, outcome: dict[str, Any]) -> None:
        self.finished = outcome

    # -- the job -------------------------------------------------------------------------------
    def trainer_for_ray(self, broker: Any) -> TorchTrainer:
        c, keep = self.config, self.trainer.config.training_args.save_total_limit
        return TorchTrainer(
            train_loop,
            train_loop_config=self.loop_config(broker),
            scaling_config=scaling(c),
            run_config=ray.train.RunConfig(
                name=self.name,
                storage_path=self.path,
                storage_filesystem=self.filesystem,
                # a worker group that cannot start within Ray's start timeout (60 s; its
                # RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) fails the run, never waits on
                failure_config=ray.train.FailureConfig(
                    max_failures=c.max_failures, controller_failure_limit=0
                ),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep),
            ),
        )

    def ray_info(self, status: str, result: Any = None) -> dict[str, Any]:
        """What the run record shows of Ray: its run, status, metrics and checkpoints."""
        info: dict[str, Any] = {
            "name": self.name,
            "storage": redact_uri(self.config.storage or self.path),
            "num_workers": self.config.num_workers,
            "status": status,
            "checkpoints": list(self.checkpoints),
        }
        if result is not None:
            info["metrics"] = dict(result.metrics or {})
            if result.checkpoint is not None:
                info["checkpoint"] = Path(result.checkpoint.path).name
        return info

    def fit(self, *, merge: bool) -> Any:
        from llmtrain.training.launch import mark_failed, store_model

        db, run_id = self.db, self.run_id
        service = DriverService(
            db,
            {
                "database": self.database,
                "resume_point": self.resume_point,
                "record_checkpoint": self.record_checkpoint,
                "finished": self.finish,
                "say": lambda text: print(text, file=sys.stderr, flush=True),
            },
            threads=self.config.num_workers,
        )
        try:
            with service:
                db.metadata.update_run(run_id, info={"ray": self.ray_info("starting")})
                try:
                    result = self.trainer_for_ray(service.broker).fit()
                    if result.error is not None:
                        raise result.error
                    if self.finished is None:
                        raise DistributedError("the Ray workers ended without finishing the run")
                except BaseException as exc:
                    db.metadata.update_run(run_id, info={"ray": self.ray_info("failed")})
                    mark_failed(db, run_id, exc)
                    raise
            done = self.finished
            return store_model(
                self.trainer,
                db,
                run_id,
                done["adapter"],
                done["history"],
                steps=done["steps"],
                tokens=done["tokens"],
                merge=merge,
                info={"ray": self.ray_info("completed", result)},
            )
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def scaling(config: RayConfig) -> Any:
    return ray.train.ScalingConfig(
        num_workers=config.num_workers,
        use_gpu=config.use_gpu,
        resources_per_worker=config.resources_per_worker,
    )


def check_resources(config: RayConfig) -> None:
    """ConfigError naming the request and what the cluster has, when the workers could never
    be placed (``use_gpu`` on a cluster without GPUs): Ray itself would wait for them."""
    wanted = scaling(config).total_resources
    have = ray.cluster_resources()
    short = sorted(name for name, amount in wanted.items() if amount > have.get(name, 0))
    if short:
        shown = {name: have.get(name, 0) for name in sorted({*wanted, "CPU", "GPU"})}
        raise ConfigError(
            f"ray_config asks for {config.num_workers} worker(s) needing {dict(wanted)} in "
            f"all, but the Ray cluster has {shown}: not enough {', '.join(short)}; lower "
            "ray_config.num_workers or resources_per_worker, or drop use_gpu"
        )


def run_on_ray(trainer: Any, db: Datalayer, run_id: str, *, resume: bool | str, merge: bool) -> Any:
    """Train run ``run_id`` on Ray; returns the trained model. Joins the Ray instance this
    process has (or ``ray_config.address``'s); one it starts itself it also shuts down."""
    config: RayConfig = trainer.config.ray_config
    started = not ray.is_initialized()
    if started:  # a quiet fit hears from its workers through the driver only (progress)
        quiet = os.environ.get(QUIET_ENV) == "1"
        ray.init(
            address=config.address,
            include_dashboard=False,
            log_to_driver=not quiet,
            logging_level=logging.ERROR if quiet else logging.INFO,
        )
    try:
        try:
            check_resources(config)
        except ConfigError as exc:
            from llmtrain.training.launch import mark_failed

            mark_failed(db, run_id, exc)
            raise
        return RayRun(trainer, db, run_id, resume=resume).fit(merge=merge)
    finally:
        if started:
            ray.shutdown()
