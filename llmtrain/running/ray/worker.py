"""One Ray Train worker: a local rank's run body, with the driver's stores and Ray's checkpoints."""

from __future__ import annotations

import functools
import io
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray.train
import torch

from llmtrain.console import quieted
from llmtrain.placement import Placement
from llmtrain.running.local import train_run
from llmtrain.running.ray.bridge import RemoteDB, call
from llmtrain.stores.metadata.base import CheckpointRecord
from llmtrain.training.checkpoint import Checkpointer, digests, rng_state, seal


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


class RayCheckpointer(Checkpointer):
    """Checkpoints reported to Ray Train, then recorded by the driver like a local run's."""

    def __init__(self, *args: Any, broker: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.broker = broker

    def save(
        self, model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any]
    ) -> CheckpointRecord | None:
        """Collective: each rank writes its files into its own folder and reports it under
        one name (Ray merges them in storage); rank 0's manifest lists every rank's files."""
        s, step = self.strategy, state["step"]
        folder = self.workdir / f"ckpt-{step}-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True)
        try:
            weights = s.trainable_state_dict(model)
            s.save_optimizer(model, optimizer, folder)
            torch.save(rng_state(), folder / f"rng_rank{s.rank}.pt")
            everyone = s.gather_object(digests(folder))
            if s.is_main:
                others = {k: v for files in everyone[1:] for k, v in files.items()}
                seal(folder, weights, scheduler, state, world_size=s.world_size, more_files=others)
            ray.train.report(
                {"step": step, "epoch": state["epoch"], "tokens": state["tokens_seen"]},
                checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
                checkpoint_dir_name=checkpoint_name(step),
            )
            s.barrier()  # every rank's files are in storage before the driver reads them
            args = (step, state["epoch"], s.world_size)
            record = call(self.broker, "driver", "record_checkpoint", *args) if s.is_main else None
            s.barrier()
            return record
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def restore(
        self, record: CheckpointRecord, model: Any, optimizer: Any, scheduler: Any
    ) -> dict[str, Any]:
        """Ray's copy if Ray restarted the group at this step, else the artifact store's."""
        reported = ray.train.get_checkpoint()
        if reported is not None and Path(reported.path).name == checkpoint_name(record.step):
            with reported.as_directory() as folder:
                return self.restore_folder(Path(folder), record.step, model, optimizer, scheduler)
        return super().restore(record, model, optimizer, scheduler)


def train_loop(config: dict[str, Any]) -> None:
    context, broker = ray.train.get_context(), config["broker"]
    placement = Placement(
        context.get_world_rank(),
        context.get_world_size(),
        context.get_local_rank(),
        launched=True,
        node_rank=context.get_node_rank(),
    )
    db = RemoteDB(broker)  # rows, records and artifacts: through the driver
    # a restarted worker group continues from the last checkpoint, as a resume does
    plan = replace(config["plan"], resume_from=call(broker, "driver", "resume_point"))
    with quieted(config["quiet"]):  # as quiet as the fit on the driver
        outcome = train_run(
            plan,
            db,  # type: ignore[arg-type]  # the broker serves every call a run makes
            placement,
            callbacks=config["callbacks"],
            checkpointer=functools.partial(RayCheckpointer, broker=broker),
            progress_stream=ToDriver(broker),
        )
    if outcome is not None:
        call(broker, "driver", "finished", outcome)


class ToDriver(io.TextIOBase):
    """The rank's progress lines, printed by the driver: a worker's own output is Ray's to
    forward, and a quiet fit has Ray forward none."""

    def __init__(self, broker: Any) -> None:
        self.broker, self.held = broker, ""

    def write(self, text: str) -> int:
        *lines, self.held = (self.held + text).split("\n")
        for line in lines:
            call(self.broker, "driver", "say", line)
        return len(text)
