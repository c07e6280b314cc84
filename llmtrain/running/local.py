"""The one body every executor runs (:func:`train_run`), with what rank 0 records around it."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from llmtrain.datalayer import Datalayer
from llmtrain.errors import ComponentNotFoundError, ConfigError, DistributedError
from llmtrain.integrations.trackers import make_trackers
from llmtrain.placement import Placement
from llmtrain.provenance.selection import run_trained
from llmtrain.stores.handle import Database
from llmtrain.stores.metadata.base import RunStatus
from llmtrain.training.callbacks import Callback, build_callback
from llmtrain.training.checkpoint import Checkpointer
from llmtrain.training.model import ModelRecord, TrainedModel
from llmtrain.training.plan import RunPlan
from llmtrain.training.run import FitRun
from llmtrain.training.strategies import make_strategy, strategy_for

log = logging.getLogger("llmtrain.training")
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """What a finished run hands back on rank 0, to be stored as its model."""

    adapter: str | None
    history: list[dict[str, float]]
    steps: int
    tokens: int


def once_per_job(placement: Placement, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on rank 0 alone when every rank of a launched job calls it (a
    script run with ``torchrun`` calling ``fit()``); every rank gets rank 0's result."""
    if not placement.in_launched_job:
        return fn(*args, **kwargs)
    group = make_strategy("ddp", placement)
    group.launch()  # the strategy's own launch() later finds the group and keeps it
    outcome: tuple[str, Any] = ("error", "rank 0 did not answer")
    if group.is_main:
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except BaseException as exc:
            group.broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
            raise
    kind, value = group.broadcast_object(outcome)
    if kind == "error":
        raise DistributedError(f"rank 0 failed: {value}")
    return value


def run_here(
    plan: RunPlan, db: Datalayer, placement: Placement, *, callbacks: Sequence[Callback] = ()
) -> TrainedModel | None:
    """Train ``plan`` here; rank 0 stores its model."""
    outcome = train_run(plan, db, placement, callbacks=callbacks)
    return None if outcome is None else store_model(plan, db, outcome)


def train_run(
    plan: RunPlan,
    db: Database,
    placement: Placement,
    *,
    callbacks: Sequence[Callback] = (),
    checkpointer: Callable[..., Checkpointer] = Checkpointer,
    progress_stream: Any = None,
) -> Outcome | None:
    """setup -> train -> final checkpoint -> adapter: the outcome on rank 0, None elsewhere. The run
    is "running" once set up: a resume that cannot start (a corrupt checkpoint) only notes why."""
    strategy = strategy_for(plan.config, placement)
    own = [build_callback(spec) for spec in plan.callbacks]
    trackers = make_trackers(plan.config.training_args.report_to) if strategy.is_main else []
    run = FitRun(
        plan,
        db,
        strategy,
        callbacks=[*own, *callbacks, *trackers],
        checkpointer=checkpointer,
        progress_stream=progress_stream,
    )
    targs, started, completed = plan.config.training_args, False, False
    try:
        run.setup()
        # the world it ran in: each rank's host and node rank (as a launcher or Ray placed it)
        where = {"host": socket.gethostname(), "node_rank": strategy.placement.node_rank}
        ranks = strategy.gather_object(where)
        if strategy.is_main:
            batch = targs.per_device_train_batch_size * targs.gradient_accumulation_steps
            nodes = len({(r["host"], r["node_rank"]) for r in ranks})
            info = {
                "strategy": strategy.name,
                "world_size": strategy.world_size,
                "global_batch_size": batch * strategy.world_size,
                "world": {"nodes": nodes, "ranks": ranks},
            }
            db.metadata.update_run(plan.run_id, status="running", info=info)
        started = True
        run.train()
        # the final state (so resuming a finished run is a no-op), then the adapter
        latest = run.checkpointer.latest() if strategy.is_main else None
        if strategy.broadcast_object(latest is None or latest.step != run.step):
            run.save_checkpoint()
        adapter = run.save_adapter()
        completed = True
    except BaseException as exc:
        if strategy.is_main and (started or plan.resume_from is None):
            mark_failed(db, plan.run_id, exc, steps=run.step, tokens=run.tokens_seen)
        elif strategy.is_main:  # the attempt never continued the run
            mark_failed(db, plan.run_id, exc, resume_refused=True)
        raise
    finally:
        run.cleanup(failed=not completed)
    return Outcome(adapter, run.history, run.step, run.tokens_seen) if strategy.is_main else None


def store_model(
    plan: RunPlan, db: Datalayer, outcome: Outcome, *, info: dict[str, Any] | None = None
) -> TrainedModel:
    """A finished run becomes the trainer's next model version and is marked completed (or
    failed, with the steps it reached, when storing fails)."""
    cfg = plan.config
    try:
        model = TrainedModel(
            ModelRecord(
                identifier=plan.identifier,
                base=cfg.model_args,
                adapter=outcome.adapter,
                full_model=cfg.lora_args is None,
                prompt_template=cfg.prompt_template,
                chat_template=cfg.data_args.chat_template,
                max_length=cfg.data_args.max_length,
                run_id=plan.run_id,
                trainer_version=plan.version,
                history=outcome.history[-200:],
                artifacts=db.artifacts.location,
            )
        )
        model.db = db
        db.add(model)
        db.metadata.update_run(
            plan.run_id,
            status="completed",
            info={
                "steps": outcome.steps,
                "tokens": outcome.tokens,
                "artifact": outcome.adapter,
                "model_version": model.version,
                "final_loss": outcome.history[-1]["loss"] if outcome.history else None,
                **(info or {}),
            },
        )
        if "source" in (run := db.metadata.get_run(plan.run_id)).info:  # what a nightly fit reads
            run_trained(db, run)
        return model
    except BaseException as exc:
        mark_failed(db, plan.run_id, exc, steps=outcome.steps, tokens=outcome.tokens)
        raise


def model_of_run(db: Datalayer, run_id: str) -> TrainedModel:
    """The model a completed run stored."""
    run = db.metadata.get_run(run_id)
    try:
        model: TrainedModel = db.load("model", run.identifier, run.info["model_version"])
    except (KeyError, ComponentNotFoundError):
        raise ConfigError(
            f"run {run_id} of {run.identifier!r} is complete but its model is no longer stored; "
            "drop resume= to train a fresh run"
        ) from None
    return model


def mark_failed(
    db: Database,
    run_id: str,
    exc: BaseException,
    *,
    steps: int | None = None,
    tokens: int | None = None,
    resume_refused: bool = False,
) -> None:
    """Record ``exc``: "interrupted" for Ctrl-C or an exit, else "failed"; a refused resume only
    notes why. A completed run stays completed; a failing store must not hide the error."""
    interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
    status: RunStatus | None = "interrupted" if interrupted else "failed"
    if resume_refused:
        status, message = None, f"resume refused: {type(exc).__name__}: {exc}"
    elif isinstance(exc, DistributedError) or (interrupted and not str(exc)):
        message = str(exc) or type(exc).__name__
    else:
        message = f"{type(exc).__name__}: {exc}"
    reached = {k: v for k, v in (("steps", steps), ("tokens", tokens)) if v is not None}
    try:
        if db.metadata.get_run(run_id).status == "completed":
            return
        db.metadata.update_run(run_id, status=status, error=message[:4000], info=reached or None)
    except Exception:  # noqa: BLE001 - the original error matters more
        log.exception("could not record the failure of run %s", run_id)
