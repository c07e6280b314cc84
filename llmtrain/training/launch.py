"""Running a fit: in this process, or (with a launcher) in worker processes."""

from __future__ import annotations

import logging
import os
from typing import Any

from llmtrain.training.run import FitRun
from llmtrain.training.strategies import Strategy, make_strategy

log = logging.getLogger("llmtrain.training")


def strategy_for(config: Any) -> Strategy:
    """DeepSpeed or FSDP when configured; DDP inside a multi-process launch; else single."""
    if config.deepspeed_config is not None:
        return make_strategy("deepspeed", config=config.deepspeed_config)
    if config.fsdp_config is not None:
        return make_strategy("fsdp", config=config.fsdp_config)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return make_strategy("ddp")
    return make_strategy("single")


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
    from llmtrain.training.model import TrainedModel

    run = FitRun(trainer, db, run_id, strategy, resume=resume)
    try:
        if strategy.is_main:
            db.metadata.update_run(run_id, status="running")
        run.setup()
        run.train()
        latest = run.checkpointer.latest() if strategy.is_main else None
        if strategy.broadcast_object(latest is None or latest.step != run.step):
            run.save_checkpoint()  # the final state, so resuming a finished run is a no-op
        adapter = run.save_adapter()
        model = None
        if strategy.is_main:
            model = TrainedModel.from_run(trainer, run_id, adapter, run.history)
            db.add(model)
            if merge:
                model.merge()
            db.metadata.update_run(run_id, status="completed", info={
                "steps": run.step, "tokens": run.tokens_seen, "artifact": adapter,
                "model_version": model.version,
                "final_loss": run.history[-1]["loss"] if run.history else None})
        return model
    except BaseException as exc:
        if strategy.is_main:
            try:
                db.metadata.update_run(run_id, status="failed",
                                       error=f"{type(exc).__name__}: {exc}"[:4000])
            except Exception:  # noqa: BLE001 - the original error matters more
                log.exception("could not mark run %s failed", run_id)
        raise
    finally:
        run.cleanup()
