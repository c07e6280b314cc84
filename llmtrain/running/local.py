"""Training a run in this process: the one body every executor runs (in process, in a
launched worker, in a Ray worker), and what rank 0 records around it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from llmtrain.errors import DistributedError
from llmtrain.integrations.trackers import make_trackers
from llmtrain.placement import Placement
from llmtrain.stores.components import check_identifier
from llmtrain.training.callbacks import Callback, build_callback
from llmtrain.training.checkpoint import Checkpointer
from llmtrain.training.model import ModelRecord, TrainedModel
from llmtrain.training.plan import RunPlan
from llmtrain.training.run import FitRun
from llmtrain.training.strategies import Strategy, make_strategy, strategy_for

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer
    from llmtrain.stores.handle import Database

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
    """``fn(*args, **kwargs)`` once: on rank 0 when every rank of a launched job calls it (a
    script run with ``torchrun``/``deepspeed`` calling ``fit()``); every rank gets rank 0's
    result."""
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
    plan: RunPlan,
    db: Datalayer,
    placement: Placement,
    *,
    callbacks: Sequence[Callback] = (),
    merge: bool = False,
) -> TrainedModel | None:
    """Train ``plan`` in this process (a rank of a launched job, or the only one) and, on
    rank 0, store its model and mark the run completed."""
    strategy = strategy_for(plan.config, placement)
    outcome = train_run(plan, db, strategy, callbacks=callbacks)
    if outcome is None:
        return None
    try:
        return store_model(plan, db, outcome, merge=merge)
    except BaseException as exc:
        mark_failed(db, plan.run_id, exc, steps=outcome.steps, tokens=outcome.tokens)
        raise


def train_run(
    plan: RunPlan,
    db: Database,
    strategy: Strategy,
    *,
    callbacks: Sequence[Callback] = (),
    checkpointer: Callable[..., Checkpointer] = Checkpointer,
    progress_stream: Any = None,
) -> Outcome | None:
    """setup -> train -> final checkpoint -> adapter: the outcome on rank 0, None elsewhere.

    Every process builds the callbacks the plan names and, on rank 0, the trackers of
    ``report_to``. The run is "running" only once its setup succeeded: a resume that cannot
    even start (a corrupt checkpoint) leaves the run's status as it was, with a note why.
    """
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
    started = completed = False
    try:
        run.setup()
        if strategy.is_main:
            db.metadata.update_run(plan.run_id, status="running", info=running_info(run))
        started = True
        adapter = train_to_end(run)
        completed = True
    except BaseException as exc:
        if strategy.is_main:
            if started or plan.resume_from is None:
                mark_failed(db, plan.run_id, exc, steps=run.step, tokens=run.tokens_seen)
            else:  # the attempt never continued the run: its status stays, the reason is noted
                note_refused_resume(db, plan.run_id, exc)
        raise
    finally:
        run.cleanup(failed=not completed)
    if not strategy.is_main:
        return None
    return Outcome(adapter, run.history, run.step, run.tokens_seen)


def store_model(
    plan: RunPlan,
    db: Datalayer,
    outcome: Outcome,
    *,
    merge: bool,
    info: dict[str, Any] | None = None,
) -> TrainedModel:
    """A finished run becomes the trainer's next model version and is marked completed: one
    rule for a local rank 0 and the Ray driver."""
    cfg = plan.config
    model = TrainedModel(
        ModelRecord(
            identifier=check_identifier(plan.identifier),
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
    if merge:  # before the first add: one fit, one model version
        model.merge(store=False)
    db.add(model)
    history = outcome.history
    db.metadata.update_run(
        plan.run_id,
        status="completed",
        info={
            "steps": outcome.steps,
            "tokens": outcome.tokens,
            "artifact": outcome.adapter,
            "model_version": model.version,
            "final_loss": history[-1]["loss"] if history else None,
            **(info or {}),
        },
    )
    return model


def running_info(run: FitRun) -> dict[str, Any]:
    """What a started run records about how it trains."""
    targs, strategy = run.targs, run.strategy
    return {
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        "global_batch_size": targs.per_device_train_batch_size
        * targs.gradient_accumulation_steps
        * strategy.world_size,
    }


def train_to_end(run: FitRun) -> str | None:
    """Collective: train, save the final state (so resuming a finished run is a no-op) and
    the adapter; returns the adapter's artifact id on rank 0."""
    run.train()
    latest = run.checkpointer.latest() if run.strategy.is_main else None
    if run.strategy.broadcast_object(latest is None or latest.step != run.step):
        run.save_checkpoint()
    return run.save_adapter()


def note_refused_resume(db: Database, run_id: str, exc: BaseException) -> None:
    """A resume that could not start (a bad checkpoint): the run keeps its status, and its
    error says why the last attempt to continue it was refused."""
    try:
        if db.metadata.get_run(run_id).status != "completed":
            message = f"resume refused: {type(exc).__name__}: {exc}"
            db.metadata.update_run(run_id, error=message[:4000])
    except Exception:  # noqa: BLE001 - the original error matters more
        log.exception("could not note the refused resume of run %s", run_id)


def mark_failed(
    db: Database,
    run_id: str,
    exc: BaseException,
    *,
    steps: int | None = None,
    tokens: int | None = None,
) -> None:
    """Record ``exc`` on the run: "interrupted" for Ctrl-C or an exit, else "failed", with the
    steps and tokens reached when known. A completed run stays completed (an interrupt that
    lands after the work is done is not the run's failure). A store that fails too must not
    hide the original error."""
    interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
    if isinstance(exc, DistributedError) or (interrupted and not str(exc)):
        message = str(exc) or type(exc).__name__
    else:
        message = f"{type(exc).__name__}: {exc}"
    reached = {k: v for k, v in (("steps", steps), ("tokens", tokens)) if v is not None}
    try:
        if db.metadata.get_run(run_id).status == "completed":
            return
        db.metadata.update_run(
            run_id,
            status="interrupted" if interrupted else "failed",
            error=message[:4000],
            info=reached or None,
        )
    except Exception:  # noqa: BLE001 - the original error matters more
        log.exception("could not mark run %s failed", run_id)
