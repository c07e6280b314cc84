"""One Ray Train worker: the same FitRun as a local or launched rank, at Ray's placement.

It gets a recipe without the database's address, the run's snapshot manifest and a channel
to the driver; rows, stores and records all go through that channel. Checkpoints go to Ray
Train (``ray.train.report``, on every rank alike) and rank 0 asks the driver to record them.
After Ray restarts the worker group, the run continues from Ray's last checkpoint.
"""

from __future__ import annotations

import functools
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import ray.train
import torch

from llmtrain.console import quieted
from llmtrain.placement import Placement
from llmtrain.running.local import train_run
from llmtrain.running.ray.bridge import Channel, RemoteDB
from llmtrain.stores.handle import Database
from llmtrain.stores.metadata.base import CheckpointRecord
from llmtrain.training.checkpoint import Checkpointer, rng_state, seal, sha256_file
from llmtrain.training.strategies import strategy_for


def checkpoint_name(step: int) -> str:
    """The folder of step ``step``'s checkpoint in the Ray run's storage."""
    return f"checkpoint-{step:08d}"


class RayCheckpointer(Checkpointer):
    """Checkpoints reported to Ray Train, then recorded by the driver like a local run's."""

    def __init__(self, *args: Any, channel: Channel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel

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
            mine = {p.name: sha256_file(p) for p in folder.iterdir() if p.is_file()}
            everyone = s.gather_object(mine)
            if s.is_main:
                others = {k: v for files in everyone[1:] for k, v in files.items()}
                seal(folder, weights, scheduler, state, world_size=s.world_size, more_files=others)
            ray.train.report(
                {"step": step, "epoch": state["epoch"], "tokens": state["tokens_seen"]},
                checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
                checkpoint_dir_name=checkpoint_name(step),
            )
            s.barrier()  # every rank's files are in storage before the driver reads them
            record = None
            if s.is_main:
                record = self.channel.call(
                    "driver", "record_checkpoint", step, state["epoch"], s.world_size
                )
            s.barrier()
            return record
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def restore(
        self, record: CheckpointRecord, model: Any, optimizer: Any, scheduler: Any
    ) -> dict[str, Any]:
        """From Ray's checkpoint when Ray restarted the group at this step, else from the
        artifact store (a resume in a new Ray job)."""
        reported = ray.train.get_checkpoint()
        if reported is not None and Path(reported.path).name == checkpoint_name(record.step):
            with reported.as_directory() as folder:
                return self.restore_folder(Path(folder), record.step, model, optimizer, scheduler)
        return super().restore(record, model, optimizer, scheduler)


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the TorchTrainer: the plan, trained as a local rank would
    (:func:`llmtrain.running.local.train_run`), at Ray's placement, through the channel."""
    from llmtrain.datalayer import connect

    context = ray.train.get_context()
    placement = Placement(
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        launched=True,
    )
    channel = Channel(config["broker"])
    # the driver's stores; the rows from the driver too, unless the workers may read the
    # database themselves (the driver then hands its address over the channel, never in the
    # worker's configuration)
    address = channel.call("driver", "database")
    own = None if address is None else connect(address)
    db = RemoteDB(channel) if own is None else RemoteDB(channel, backend=own.backend, uri=own.uri)
    # a restarted worker group continues from the last checkpoint, as a resume does
    plan = replace(config["plan"], resume_from=channel.call("driver", "resume_point"))
    strategy = strategy_for(plan.config, placement)
    with quieted(config["quiet"]):  # as quiet as the fit on the driver
        outcome = train_run(
            plan,
            cast(Database, db),  # the channel serves every call a run makes of its stores
            strategy,
            callbacks=config["callbacks"],
            checkpointer=functools.partial(RayCheckpointer, channel=channel),
            progress_stream=ToDriver(channel),
        )
    if outcome is not None:
        channel.call("driver", "finished", outcome)


class ToDriver:
    """A text stream whose lines the driver prints (the rank's progress lines): a worker's
    own output is Ray's to forward, and a quiet fit has Ray forward none."""

    def __init__(self, channel: Channel) -> None:
        self.channel, self.held = channel, ""

    def write(self, text: str) -> int:
        self.held += text
        *lines, self.held = self.held.split("\n")
        for line in lines:
            self.channel.call("driver", "say", line)
        return len(text)

    def flush(self) -> None:
        """Lines go as they end."""

    def isatty(self) -> bool:
        return False
