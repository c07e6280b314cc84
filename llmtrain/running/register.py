"""Registration (rank 0 of a job, or the Ray driver) decides a run once: checks the fit,
records the trainer version and the run, and returns the RunPlan every executor trains."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmtrain.config.args import TrainerConfig, build
from llmtrain.config.spec import FitSpec
from llmtrain.console import say
from llmtrain.data.snapshot import MixedView, RunSnapshot, take_snapshot
from llmtrain.datalayer import Datalayer
from llmtrain.db.queries import Mix
from llmtrain.errors import ComponentNotFoundError, ConfigError, DataChangedError, DataError
from llmtrain.formatting import Formatter
from llmtrain.integrations.trackers import check_trackers
from llmtrain.objectives import objective_of
from llmtrain.stores.metadata.base import CheckpointRecord, RunRecord
from llmtrain.training.modeling import check_model_path, load_tokenizer, target_modules_for
from llmtrain.training.plan import Done, RunPlan
from llmtrain.versions import library_versions

log = logging.getLogger("llmtrain.training")
TRAINER = "trainer"
FIRST_ROWS = 16  #: rows read to tell whether a field exists (documents need not share fields)


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
    """Check, then record the trainer version (unless stored already) and the run; a resume
    reads its run's snapshot and record (no scan of the rows)."""
    from llmtrain.provenance.selection import eval_rows, pin_init_from, select_rows

    fit = config.fit
    assert fit is not None  # set by fit() before it registers
    check_before_recording(config, fit, db)
    config = pin_init_from(db, config)
    version = stored_version(db, config, loaded_version)
    found = run_to_resume(db, config.identifier, version, resume) if resume else None
    if found is not None:
        run, checkpoint = found
        if run.status == "completed":
            return Done(run.run_id)
        # this attempt's callbacks, where its launched workers read them
        db.metadata.update_run(run.run_id, info={"callbacks": list(callbacks)})
        return replace(RunPlan.from_record(run), resume_from=checkpoint, callbacks=callbacks)

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
            f"{parent['run_id']}: returning its model v{parent['model_version']}, recording nothing"
        )
        return Done(parent["run_id"])
    config = config.model_copy(
        update={"fit": fit.model_copy(update={"data_fingerprint": snapshot.fingerprint})}
    )
    prepared = objective_of(config).prepare(db, config, snapshot)  # may refuse: first
    if version is None:  # the recipe as given; the run records what its objective derived
        payload = config.model_dump(mode="json")
        version = db.metadata.add_component(TRAINER, config.identifier, payload)
    config = prepared
    held = eval_rows(db, config)
    plan = RunPlan(
        uuid.uuid4().hex, version, config, snapshot, None, rows.get("parent"), callbacks, held
    )
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
            "eval_snapshot": held.to_record() if held else None,
            "callbacks": list(callbacks),
            **rows,
        },
    )
    return plan


def new_snapshot(
    db: Datalayer, config: TrainerConfig, loaded: int | None, allow: bool, incremental: bool
) -> RunSnapshot:
    """A new run's snapshot; a replay (not incremental) compares it with the fit it replays."""
    fit, data = config.fit, config.data_args
    assert fit is not None
    snapshot = take_snapshot(
        db, fit.query(), eval_fraction=data.eval_fraction, version_column=data.version_column
    )
    if snapshot.count == 0:
        raise DataError(
            f"{fit.query().source} selects 0 rows (forgotten rows, db.forget, are left out): "
            "nothing to train on"
        )
    if isinstance(query := fit.query(), Mix) and isinstance(snapshot.train, MixedView):
        for part, view, weight in zip(query.parts, snapshot.train.parts, query.weights or ()):
            if view.count == 0:
                raise DataError(f"mix(): {part.select.source} has no rows, but weight {weight:g}")
    replay = fit.data_fingerprint and fit.db == db.uri and not incremental
    if replay and fit.data_fingerprint != snapshot.fingerprint:
        message = (
            f"the rows of {fit.query().source} changed since trainer {config.identifier!r} "
            f"v{loaded} was fitted (data fingerprint {fit.data_fingerprint} -> "
            f"{snapshot.fingerprint})"
        )
        if not allow:
            raise DataChangedError(message + "; pass allow_changed_data=True to train anyway")
        log.warning("%s; training anyway as asked", message)
    return snapshot


def stored_version(db: Datalayer, config: TrainerConfig, loaded: int | None) -> int | None:
    """The stored version with this recipe (not its data fingerprint or URI; read through today's
    schema): the loaded one (a replay of vN stays vN), else the newest; None when it is new."""

    def recipe(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "fit": {**(d.get("fit") or {}), "data_fingerprint": None, "db": None}}

    mine = recipe(config.model_dump(mode="json"))
    for version in dict.fromkeys([loaded, None]):
        try:
            stored = db.metadata.get_component(TRAINER, config.identifier, version)
            if recipe(build(TrainerConfig, stored.payload).model_dump(mode="json")) == mine:
                return stored.version
        except (ComponentNotFoundError, ConfigError):
            continue
    return None


def run_to_resume(
    db: Datalayer, identifier: str, version: int | None, resume: bool | str
) -> tuple[RunRecord, CheckpointRecord | None] | None:
    """The newest run of this recipe with the wanted checkpoint, and that checkpoint (None if it
    completed); another version's is an error: it would train one recipe's run as another's."""
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


def check_before_recording(config: TrainerConfig, fit: FitSpec, db: Datalayer) -> None:
    """ConfigError/QueryError before anything is recorded for a fit that cannot train. A
    MongoDB field missing from every one of the first rows is taken for a mistyped name."""
    check_trackers(config.training_args.report_to)  # a loaded trainer, on this machine
    check_model_folder(config)  # no row read for these
    if config.data_args.chat_template:  # probed as the run will: no template, no tags
        Formatter(load_tokenizer(config.model_args), chat_template=True)
    for query, named in fit.sources():
        rows = db.backend.fetch_rows(query, [n for _, n in named], None, FIRST_ROWS)
        for role, name in named:
            if rows and not any(name in row for _, row in rows):
                raise ConfigError(
                    f"fit({role}={name!r}): no field {name!r} in the first {len(rows)} row(s) "
                    f"of {query.source}; fields there: {sorted({f for _, r in rows for f in r})}"
                )


def check_model_folder(config: TrainerConfig) -> None:
    """A local model folder, and the LoRA targets against its linear layers (on a skeleton)."""
    margs, name = config.model_args, config.model_args.model_name_or_path
    check_model_path(name)
    folder = Path(os.path.expanduser(name))
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"model_args.model_name_or_path: {name!r} is a file, not a model folder")
    if not folder.exists() or config.lora_args is None:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    trust = margs.trust_remote_code
    try:
        hf = AutoConfig.from_pretrained(folder, revision=margs.revision, trust_remote_code=trust)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf, trust_remote_code=trust)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model_args.model_name_or_path: cannot read {folder}: {exc}") from None
    target_modules_for(skeleton, config.lora_args)
