"""Running a fit: in this process, or (with a launcher) in worker processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from llmtrain.training.run import FitRun
from llmtrain.training.strategies import Strategy, make_strategy

log = logging.getLogger("llmtrain.training")
T = TypeVar("T")


def strategy_for(config: Any) -> Strategy:
    """DeepSpeed or FSDP when configured; DDP inside a multi-process launch; else single."""
    if config.deepspeed_config is not None:
        return make_strategy("deepspeed", config=config.deepspeed_config,
                             training_args=config.training_args)
    if config.fsdp_config is not None:
        return make_strategy("fsdp", config=config.fsdp_config)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return make_strategy("ddp")
    return make_strategy("single")


def in_launched_job() -> bool:
    """This process is one rank of several started by torchrun or deepspeed."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1


def once_per_job(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` once: on rank 0 when every rank of a launched job calls it (a script run
    with ``torchrun``/``deepspeed`` calling ``fit()``); every rank gets rank 0's result."""
    if not in_launched_job():
        return fn(*args)
    from llmtrain.errors import DistributedError

    group = make_strategy("ddp")
    group.launch()  # the strategy's own launch() later finds the group and keeps it
    outcome: tuple[str, Any] = ("error", "rank 0 did not answer")
    if group.is_main:
        try:
            outcome = ("ok", fn(*args))
        except BaseException as exc:
            group.broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
            raise
    kind, value = group.broadcast_object(outcome)
    if kind == "error":
        raise DistributedError(f"rank 0 failed: {value}")
    return value


def execute(trainer: Any, db: Any, run_id: str, *, resume: bool | str, merge: bool) -> Any:
    launcher = trainer.config.launcher
    if launcher is not None and launcher.kind != "python" and "LOCAL_RANK" not in os.environ:
        from llmtrain.launchers import launch_workers

        return launch_workers(trainer, db, run_id, resume=resume, merge=merge)
    return run_in_process(trainer, db, run_id, strategy_for(trainer.config), resume=resume,
                          merge=merge)


def run_in_process(trainer: Any, db: Any, run_id: str, strategy: Strategy, *,
                   resume: bool | str, merge: bool) -> Any:
    """setup -> train -> final checkpoint -> adapter -> model component; marks the run."""
    from llmtrain.launchers.report import write_rank_report
    from llmtrain.training.model import TrainedModel

    run = FitRun(trainer, db, run_id, strategy, resume=resume)
    try:
        if strategy.is_main:
            db.metadata.update_run(run_id, status="running")
        run.setup()
        if strategy.is_main:
            targs = trainer.config.training_args
            db.metadata.update_run(run_id, info={
                "strategy": strategy.name, "world_size": strategy.world_size,
                "global_batch_size": targs.per_device_train_batch_size
                * targs.gradient_accumulation_steps * strategy.world_size})
        run.train()
        write_rank_report(run)  # only when LLMTRAIN_RANK_REPORT names a path (tests)
        latest = run.checkpointer.latest() if strategy.is_main else None
        if strategy.broadcast_object(latest is None or latest.step != run.step):
            run.save_checkpoint()  # the final state, so resuming a finished run is a no-op
        adapter = run.save_adapter()
        model = None
        if strategy.is_main:
            model = TrainedModel.from_run(trainer, run_id, adapter, run.history)
            if merge:  # before the first add: one fit, one model version
                model.merge(store=False)
            db.add(model)
            db.metadata.update_run(run_id, status="completed", info={
                "steps": run.step, "tokens": run.tokens_seen, "artifact": adapter,
                "model_version": model.version,
                "final_loss": run.history[-1]["loss"] if run.history else None})
        return model
    except BaseException as exc:
        if strategy.is_main:
            mark_failed(db, run_id, exc)
        raise
    finally:
        run.cleanup()


def mark_failed(db: Any, run_id: str, exc: BaseException) -> None:
    """Record ``exc`` on the run; a store that fails too must not hide the original error."""
    from llmtrain.errors import DistributedError

    message = str(exc) if isinstance(exc, DistributedError) else f"{type(exc).__name__}: {exc}"
    try:
        db.metadata.update_run(run_id, status="failed", error=message[:4000])
    except Exception:  # noqa: BLE001 - the original error matters more
        log.exception("could not mark run %s failed", run_id)
