"""The driver of a Ray fit keeps the database: it answers the workers' calls, copies their
checkpoints into the artifact store, and stores the model as a local rank 0 does."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from llmtrain.config.args import RayConfig
from llmtrain.console import QUIET_ENV
from llmtrain.datalayer import Datalayer
from llmtrain.errors import ConfigError, DistributedError
from llmtrain.running.local import Outcome, mark_failed, store_model
from llmtrain.running.ray.bridge import RemoteDB, serving
from llmtrain.running.ray.worker import checkpoint_name, train_loop
from llmtrain.stores.artifacts.fsspec_store import check_url
from llmtrain.stores.metadata.base import CheckpointRecord
from llmtrain.training.callbacks import Callback
from llmtrain.training.checkpoint import Checkpointer, verify
from llmtrain.training.model import TrainedModel
from llmtrain.training.plan import RunPlan
from llmtrain.uri import redact_uri


def storage_location(storage: str | None) -> tuple[str, Any]:
    """(path for Ray, pyarrow filesystem or None): a folder, or an fsspec URL (env credentials)."""
    if storage is None or "://" not in storage or storage.startswith("file://"):
        folder = (storage or "~/ray_results").removeprefix("file://")
        return str(Path(folder).expanduser().absolute()), None
    import pyarrow.fs  # type: ignore[import-untyped]
    from fsspec.core import url_to_fs

    check_url(storage, "ray_config.storage")
    filesystem, path = url_to_fs(storage, use_listings_cache=False)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(filesystem))


class RayRun:
    """One attempt at training a run on Ray (a resume is another attempt)."""

    def __init__(self, plan: RunPlan, db: Datalayer, callbacks: Sequence[Callback]) -> None:
        assert plan.config.ray_config is not None
        self.plan, self.db, self.callbacks = plan, db, list(callbacks)
        self.config: RayConfig = plan.config.ray_config
        self.name = f"llmtrain-{plan.run_id[:12]}-{uuid.uuid4().hex[:8]}"
        self.path, self.filesystem = storage_location(self.config.storage)
        self.finished: list[Outcome] = []  #: rank 0's outcome, once it finished the run
        self.checkpoints: list[CheckpointRecord] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="llmtrain-ray-"))
        keep = plan.config.training_args.save_total_limit
        self.checkpointer = Checkpointer(db, plan.run_id, None, keep=keep, workdir=self.workdir)  # type: ignore[arg-type]

    def loop_config(self, broker: Any) -> dict[str, Any]:
        """What a worker gets, and nothing that locates the database."""
        fit = self.plan.fit.model_copy(update={"db": RemoteDB.uri})
        plan = replace(self.plan, config=self.plan.config.model_copy(update={"fit": fit}))
        quiet = os.environ.get(QUIET_ENV) == "1"  # as quiet as the fit on the driver
        return {"broker": broker, "plan": plan, "callbacks": self.callbacks, "quiet": quiet}

    def resume_point(self) -> CheckpointRecord | None:
        """The newest checkpoint of this attempt (Ray restarted the group), else the plan's."""
        return self.checkpoints[-1] if self.checkpoints else self.plan.resume_from

    def record_checkpoint(self, step: int, epoch: int, world_size: int) -> CheckpointRecord:
        """Copy a reported checkpoint from Ray's storage into the artifact store; record it."""
        name = checkpoint_name(step)
        source = ray.train.Checkpoint(f"{self.path}/{self.name}/{name}", self.filesystem)
        folder = self.workdir / name
        try:
            source.to_directory(str(folder))
            verify(folder)
            state = {"step": step, "epoch": epoch, "world_size": world_size}
            record = self.checkpointer.record(folder, state)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.checkpoints.append(record)
        return record

    def ray_info(self, status: str, result: Any = None) -> dict[str, Any]:
        info: dict[str, Any] = {
            "name": self.name,
            "storage": redact_uri(self.config.storage or self.path),
            "num_workers": self.config.num_workers,
            "status": status,
            "checkpoints": [checkpoint_name(c.step) for c in self.checkpoints],
        }
        if result is not None:
            info["metrics"] = dict(result.metrics or {})
            if result.checkpoint is not None:
                info["checkpoint"] = Path(result.checkpoint.path).name
        return info

    def fit(self) -> TrainedModel:
        db, run_id, c = self.db, self.plan.run_id, self.config
        calls: dict[str, Callable[..., Any]] = {
            "resume_point": self.resume_point,
            "record_checkpoint": self.record_checkpoint,
            "finished": self.finished.append,
            "say": lambda text: print(text, file=sys.stderr, flush=True),
        }
        try:
            with serving(db, calls, threads=c.num_workers) as broker:
                db.metadata.update_run(run_id, info={"ray": self.ray_info("starting")})
                try:
                    result = TorchTrainer(
                        train_loop,
                        train_loop_config=self.loop_config(broker),
                        scaling_config=scaling(c),
                        run_config=ray.train.RunConfig(
                            name=self.name,
                            storage_path=self.path,
                            storage_filesystem=self.filesystem,
                            # a worker group that cannot start within Ray's start timeout (60 s;
                            # RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) fails the run
                            failure_config=ray.train.FailureConfig(  # type: ignore[call-arg]
                                max_failures=c.max_failures, controller_failure_limit=0
                            ),
                            checkpoint_config=ray.train.CheckpointConfig(
                                num_to_keep=self.plan.config.training_args.save_total_limit
                            ),
                        ),
                    ).fit()
                    if result.error is not None:
                        raise result.error
                    if not self.finished:
                        raise DistributedError("the Ray workers ended without finishing the run")
                except BaseException as exc:
                    db.metadata.update_run(run_id, info={"ray": self.ray_info("failed")})
                    mark_failed(db, run_id, exc)
                    raise
            info = {"ray": self.ray_info("completed", result)}
            return store_model(self.plan, db, self.finished[-1], info=info)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def scaling(config: RayConfig) -> Any:
    return ray.train.ScalingConfig(
        num_workers=config.num_workers,
        use_gpu=config.use_gpu,
        resources_per_worker=config.resources_per_worker,
    )


@contextlib.contextmanager
def ray_session(config: RayConfig) -> Iterator[None]:
    """This process's Ray instance (one it starts is shut down after); workers the cluster
    could never place (Ray would wait for them) are refused before anything is recorded."""
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
        wanted, have = scaling(config).total_resources, ray.cluster_resources()
        short = sorted(name for name, amount in wanted.items() if amount > have.get(name, 0))
        if short:
            shown = {name: have.get(name, 0) for name in sorted({*wanted, "CPU", "GPU"})}
            raise ConfigError(
                f"ray_config asks for {config.num_workers} worker(s) needing {dict(wanted)} in "
                f"all, but the Ray cluster has {shown}: not enough {', '.join(short)}; lower "
                "ray_config.num_workers or resources_per_worker, or drop use_gpu"
            )
        yield
    finally:
        if started:
            ray.shutdown()
