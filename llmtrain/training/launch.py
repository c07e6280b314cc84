"""Running a fit in this process: once per job, then the run itself.

Starting worker processes is the launchers' job (``llmtrain.launchers.execute``); they call
into here, never the other way round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from llmtrain.placement import Placement
from llmtrain.training.run import FitRun
from llmtrain.training.strategies import Strategy, make_strategy

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

log = logging.getLogger("llmtrain.training")
T = TypeVar("T")


def once_per_job(placement: Placement, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` once: on rank 0 when every rank of a launched job calls it (a script run
    with ``torchrun``/``deepspeed`` calling ``fit()``); every rank gets rank 0's result."""
    if not placement.in_launched_job:
        return fn(*args)
    from llmtrain.errors import DistributedError

    group = make_strategy("ddp", placement)
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


def run_in_process(
    trainer: Any, db: Datalayer, run_id: str, strategy: Strategy, *, resume: bool | str, merge: bool
) -> Any:
    """setup -> train -> final checkpoint -> adapter -> model component; marks the run.

    The run is "running" only once its setup succeeded: a resume attempt that cannot even
    start (rows changed, a corrupt checkpoint) leaves the run's record as it was, and nothing
    after "completed" changes that status again.
    """
    run = FitRun(trainer, db, run_id, strategy, resume=resume)
    started = completed = False
    try:
        run.setup()
        if strategy.is_main:
            db.metadata.update_run(run_id, status="running", info=running_info(run))
        started = True
        adapter = train_to_end(run)
        model = None
        if strategy.is_main:
            model = store_model(
                trainer,
                db,
                run_id,
                adapter,
                run.history,
                steps=run.step,
                tokens=run.tokens_seen,
                merge=merge,
            )
        completed = True
        return model
    except BaseException as exc:
        if not strategy.is_main or completed:
            raise
        if started or not resume:
            mark_failed(db, run_id, exc, steps=run.step, tokens=run.tokens_seen)
        else:  # the attempt never continued the run: its status stays, the reason is noted
            note_refused_resume(db, run_id, exc)
        raise
    finally:
        run.cleanup(failed=not completed)


def store_model(
    trainer: Any,
    db: Datalayer,
    run_id: str,
    adapter: str | None,
    history: list[dict[str, float]],
    *,
    steps: int,
    tokens: int,
    merge: bool,
    info: dict[str, Any] | None = None,
) -> Any:
    """A finished run becomes the trainer's next model version and is marked completed: one
    rule for a local rank 0 and the Ray driver."""
    from llmtrain.training.model import TrainedModel

    model = TrainedModel.from_run(trainer, run_id, adapter, history)
    if merge:  # before the first add: one fit, one model version
        model.merge(store=False)
    db.add(model)
    db.metadata.update_run(
        run_id,
        status="completed",
        info={
            "steps": steps,
            "tokens": tokens,
            "artifact": adapter,
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


def note_refused_resume(db: Datalayer, run_id: str, exc: BaseException) -> None:
    """A resume that could not start (rows changed, a bad checkpoint): the run keeps its
    status, and its error says why the last attempt to continue it was refused."""
    try:
        if db.metadata.get_run(run_id).status != "completed":
            message = f"resume refused: {type(exc).__name__}: {exc}"
            db.metadata.update_run(run_id, error=message[:4000])
    except Exception:  # noqa: BLE001 - the original error matters more
        log.exception("could not note the refused resume of run %s", run_id)


def mark_failed(
    db: Datalayer,
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
    from llmtrain.errors import DistributedError

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
