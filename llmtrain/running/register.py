"""Registration: one plan per run (:class:`~llmtrain.training.plan.RunPlan`), decided once.

Registration (rank 0 of a job, or the Ray driver) checks the fit, reads the resumed run's
snapshot or takes a new one, picks its rows (less forgotten ones; incremental: the new ones
only), stores the trainer version and the run record, and resolves the checkpoint a resume
starts from. The result is one frozen :class:`RunPlan`: the executors (in process, launched
workers, Ray workers) receive it and decide none of it again. A launched worker reads it
back from the run record, which holds every field of it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmtrain.config.args import TrainerConfig, build
from llmtrain.console import say
from llmtrain.data.snapshot import RunSnapshot, take_snapshot
from llmtrain.errors import ComponentNotFoundError, ConfigError, DataChangedError, DataError
from llmtrain.running.preflight import check_before_recording
from llmtrain.stores.metadata.base import CheckpointRecord, RunRecord
from llmtrain.training.plan import Done, RunPlan
from llmtrain.versions import library_versions

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

log = logging.getLogger("llmtrain.training")
TRAINER = "trainer"


def register(
    db: Datalayer,
    config: TrainerConfig,
    loaded_version: int | None,
    *,
    resume: bool | str,
    allow_changed_data: bool,
    incremental: bool,
    allow_forgotten_parent: bool = False,
    callbacks: tuple[str, ...],
) -> RunPlan | Done:
    """Check, then record: the trainer version (unless stored already) and the run. A fit
    that cannot train fails in :func:`check_before_recording` and records nothing; a resume
    reads its run's snapshot and record (no scan of the rows)."""
    check_before_recording(config, db)
    version = stored_version(db, config, loaded_version)
    found = run_to_resume(db, config.identifier, version, resume) if resume else None
    if found is not None:
        run, checkpoint = found
        if run.status == "completed":
            return Done(run.run_id)
        # this attempt's callbacks, where its launched workers read them
        db.metadata.update_run(run.run_id, info={"callbacks": list(callbacks)})
        plan = RunPlan.from_record(run)
        return replace(plan, resume_from=checkpoint, callbacks=callbacks)
    from llmtrain.provenance.selection import select_rows

    fit = config.fit
    assert fit is not None  # set by fit() before it registers
    snapshot = new_snapshot(db, config, loaded_version, allow_changed_data, incremental)
    snapshot, rows = select_rows(
        db, config, snapshot, incremental=incremental, allow_forgotten_parent=allow_forgotten_parent
    )
    if incremental and snapshot.train.count == 0:
        parent = rows.get("parent")
        if parent is None:  # every row trained, but by runs that made no model
            raise DataError(f"{fit.query().source}: no new rows and no model to continue from")
        say(
            f"{config.identifier}: nothing new in {fit.query().source} since run "
            f"{parent['run_id']}: returning its model v{parent['model_version']}, recording "
            "nothing"
        )
        return Done(parent["run_id"])
    config = config.model_copy(
        update={"fit": fit.model_copy(update={"data_fingerprint": snapshot.fingerprint})}
    )
    if version is None:
        payload = config.model_dump(mode="json")
        version = db.metadata.add_component(TRAINER, config.identifier, payload)
    plan = RunPlan(uuid.uuid4().hex, version, config, snapshot, None, rows.get("parent"), callbacks)
    db.metadata.create_run(
        plan.run_id,
        TRAINER,
        config.identifier,
        version,
        {
            "config": config.model_dump(mode="json"),
            "query": fit.select,
            "X": fit.X,
            "Y": fit.Y,
            "data_fingerprint": snapshot.fingerprint,
            "db": db.uri,
            "artifacts": db.artifacts.location,
            "versions": library_versions(),
            "allow_changed_data": allow_changed_data,
            "snapshot": snapshot.to_record(),
            "callbacks": list(callbacks),
            **rows,
        },
    )
    return plan


def new_snapshot(
    db: Datalayer,
    config: TrainerConfig,
    loaded_version: int | None,
    allow: bool,
    incremental: bool = False,
) -> RunSnapshot:
    """A new run's snapshot of its rows; a replay first compares it with the fit it replays
    (not an incremental fit, which is meant for rows that changed)."""
    fit, data = config.fit, config.data_args
    assert fit is not None
    snapshot = take_snapshot(
        db,
        fit.query(),
        eval_fraction=data.eval_fraction,
        version_column=data.version_column,
    )
    if snapshot.count == 0:
        raise DataError(f"{fit.query().source} selects 0 rows: nothing to train on")
    replay = fit.data_fingerprint and fit.db == db.uri and not incremental
    if replay and fit.data_fingerprint != snapshot.fingerprint:
        message = (
            f"the rows of {fit.query().source} changed since trainer {config.identifier!r} "
            f"v{loaded_version} was fitted (data fingerprint {fit.data_fingerprint} -> "
            f"{snapshot.fingerprint})"
        )
        if not allow:
            raise DataChangedError(message + "; pass allow_changed_data=True to train anyway")
        log.warning("%s; training anyway as asked", message)
    return snapshot


def stored_version(db: Datalayer, config: TrainerConfig, loaded: int | None) -> int | None:
    """The stored version with this recipe: the loaded one (a replay of version N stays
    version N), else the newest; None when this recipe is new."""
    mine = config.model_dump(mode="json")
    for version in dict.fromkeys([loaded, None]):
        try:
            stored = db.metadata.get_component(TRAINER, config.identifier, version)
        except ComponentNotFoundError:
            continue
        if same_recipe(stored.payload, mine):
            return stored.version
    return None


def same_recipe(stored: dict[str, Any], current: dict[str, Any]) -> bool:
    """Same settings and selection: the data fingerprint and the database URI (a relative
    SQLite path, a redacted password) describe where and when, not the recipe. The stored
    record is read through today's schema, so an option added since is at its default."""

    def strip(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "fit": {**(d.get("fit") or {}), "data_fingerprint": None, "db": None}}

    try:
        stored = build(TrainerConfig, stored).model_dump(mode="json")
    except ConfigError:
        return False
    return strip(stored) == strip(current)


def run_to_resume(
    db: Datalayer, identifier: str, version: int | None, resume: bool | str
) -> tuple[RunRecord, CheckpointRecord | None] | None:
    """The newest run of this recipe with the wanted checkpoint, and that checkpoint (None
    for a completed run); None when there is none. A resumable run of another version of
    the trainer is an error: it would train one recipe's run with another's settings."""
    latest = resume in (True, "latest")
    others = []
    for run in reversed(db.metadata.list_runs(TRAINER, identifier)):
        checkpoints = db.metadata.list_checkpoints(run.run_id)
        wanted = [c for c in checkpoints if latest or str(resume) in (c.artifact_id, str(c.step))]
        if not wanted:
            continue
        if version is not None and run.version == version:
            if run.status == "completed":
                log.info("run %s of %s v%d is complete", run.run_id, identifier, version)
                return run, None
            return run, wanted[-1]
        others.append(run)
    if others:
        this = "a new version" if version is None else f"v{version}"
        newest = others[0]
        raise ConfigError(
            f"fit(resume=): the run to resume ({newest.run_id}) is of trainer {identifier!r} "
            f"v{newest.version}, but this recipe is {this}; a resume continues only a run of "
            "the same recipe: drop resume= to start a fresh run, or resume with "
            f"db.load('trainer', {identifier!r}, version={newest.version}).fit(resume=True)"
        )
    if not latest:
        raise ConfigError(
            f"fit(resume={resume!r}): no run of trainer {identifier!r} has that checkpoint "
            "(give a step or a checkpoint's artifact id, or resume=True)"
        )
    log.info("nothing to resume for %s: starting a new run", identifier)
    return None
