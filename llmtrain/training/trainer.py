"""LLMTrainer: the component users create, fit, store and replay."""

from __future__ import annotations

import logging
import os
import textwrap
import typing
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from llmtrain.components import check_identifier, register_component
from llmtrain.console import quiet_unless_verbose
from llmtrain.datasets.snapshot import RunSnapshot, take_snapshot
from llmtrain.errors import ConfigError, DataChangedError, DataError
from llmtrain.queries import Query
from llmtrain.trackers import check_trackers
from llmtrain.training.args import TrainerConfig, build, keyword_reference
from llmtrain.training.spec import FitSpec
from llmtrain.versions import library_versions

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

log = logging.getLogger("llmtrain.training")


@register_component
class LLMTrainer:
    """Fine-tunes a causal LM with LoRA, QLoRA (``bits=4``) or DoRA on database rows.

    ``LLMTrainer("sft-v1", model="...", bits=4, qlora=True, prompt_template="...{X}...{Y}")``
    or the granular form with ``model_args=``, ``lora_args=``, ``training_args=`` and
    ``data_args=`` (argument models or dicts). A flat keyword sets one field of those
    sections; giving a field twice with different values is an error, and so is a keyword
    that names no field. ``lora_args=None`` fine-tunes all weights. Bad values and
    combinations that cannot work are refused here, before any data is read.
    """

    type_id: ClassVar[str] = "trainer"

    #: the last fit's snapshot of its selection's keys (a RunSnapshot), which its run reads
    data_snapshot: Any = None

    def __init__(self, identifier: str, **options: Any) -> None:
        self.config: TrainerConfig = _config(identifier, options)
        check_trackers(self.config.training_args.report_to)
        self.version: int | None = None
        self.db: Datalayer | None = None

    # -- component protocol ----------------------------------------------------------------
    @property
    def identifier(self) -> str:
        return self.config.identifier

    def to_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLMTrainer:
        trainer = cls.__new__(cls)
        trainer.config, trainer.version, trainer.db = build(TrainerConfig, data), None, None
        return trainer

    def _attach(self, db: Datalayer) -> None:
        self.db = db

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LLMTrainer) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        model = self.config.model_args.model_name_or_path
        return f"LLMTrainer({self.identifier!r}, model={model!r}, version={self.version})"

    # -- training --------------------------------------------------------------------------
    @quiet_unless_verbose
    def fit(
        self,
        X: str | None = None,
        Y: str | None = None,
        db: Datalayer | None = None,  # noqa: N803
        select: Query | None = None,
        *,
        eval_select: Query | None = None,
        resume: bool | str = False,
        merge: bool = False,
        allow_changed_data: bool | None = None,
        incremental: bool = False,
        verbose: bool = False,
    ) -> Any:
        """Train on ``select``'s rows (``X`` -> prompt, ``Y`` -> response) and store the result.

        With no arguments, a trainer loaded by ``db.load`` replays its last fit. Returns the
        trained model component (``db.load("model", identifier)`` gives it back later).
        ``resume=`` continues the newest run of this same recipe (trainer version) from a
        checkpoint; another version's run is refused, a completed run returns its model.
        ``allow_changed_data=True`` replays a fit even though the rows changed since it (a
        resume reads its run's snapshot of the rows, so only a checkpoint older than
        snapshots can find them changed): for this call only, recorded on the run, never in
        the trainer's recipe (default: ``data_args.allow_changed_data``).
        ``incremental=True`` trains only the rows of the selection that no completed run of
        this trainer trained on (new keys; with ``data_args.version_column`` also rows whose
        version changed), starting from the newest model's adapter; the run records its
        parent, and with nothing new the newest model is returned. Third-party
        banners, warnings and loading bars stay out of the output unless ``verbose=True``.
        """
        from llmtrain.datalayer import require_datalayer
        from llmtrain.launchers import execute
        from llmtrain.placement import Placement
        from llmtrain.training.launch import once_per_job

        db = db if db is not None else self.db
        if db is None:
            raise ConfigError("fit() needs db=: the database to read rows from and store into")
        require_datalayer(db, "fit(db=)")
        allow = (
            self.config.data_args.allow_changed_data
            if allow_changed_data is None
            else allow_changed_data
        )
        for name, value in (("allow_changed_data", allow), ("incremental", incremental)):
            if not isinstance(value, bool):
                raise ConfigError(f"fit({name}=) must be True or False, got {value!r}")
        spec = self._fit_spec(X, Y, db, select, eval_select)
        placement = Placement.from_environment()  # resolved once for the whole fit
        self.config.fit, self.db = spec, db
        # under torchrun/deepspeed every rank runs fit(): rank 0 alone snapshots the rows,
        # stores and opens the run; the others get the snapshot's manifest from it
        self.version, run_id, state, snapshot = once_per_job(
            placement, self._register, db, resume, allow, incremental
        )
        self.data_snapshot = snapshot
        self.config.fit = spec.model_copy(update={"data_fingerprint": snapshot.fingerprint})
        if state == "complete":  # resuming a completed run trains nothing: its model is it
            return _model_of_run(db, self.identifier, run_id)
        return execute(
            self, db, run_id, placement, resume=resume if state == "resume" else False, merge=merge
        )

    def _register(
        self, db: Datalayer, resume: bool | str, allow: bool, incremental: bool = False
    ) -> tuple[int | None, str, str, RunSnapshot]:
        """Check, then record: the trainer version (unless stored already) and the run.
        Returns (version, run id, "new" | "resume" | "complete", the run's snapshot). A
        resume reads its run's snapshot from the run record (no scan of the rows); a new run
        takes one. A fit that cannot train fails in :func:`check_before_recording` and
        records nothing."""
        from llmtrain.training.preflight import check_before_recording

        check_before_recording(self.config, db)
        version = self._stored_version(db)
        found = self._run_to_resume(db, version, resume) if resume else None
        if resume and found is None:
            if resume not in (True, "latest"):
                raise ConfigError(
                    f"fit(resume={resume!r}): no run of trainer {self.identifier!r} has that "
                    "checkpoint (give a step or a checkpoint's artifact id, or resume=True)"
                )
            log.info("nothing to resume for %s: starting a new run", self.identifier)
        if found is not None:
            run, complete = found
            snapshot = self._run_snapshot(db, run, allow)
            self.version = version
            if not complete:
                db.metadata.update_run(run.run_id, info={"allow_changed_data": allow})
            return version, run.run_id, "complete" if complete else "resume", snapshot
        # a new run: less forgotten rows, and trained ones if incremental
        from llmtrain.training.incremental import select_rows

        snapshot = self._run_snapshot(db, None, allow or incremental)
        snapshot, rows = select_rows(db, self, snapshot, incremental=incremental)
        if incremental and snapshot.train.count == 0 and "parent" in rows:
            log.info("%s: no new rows since run %s", self.identifier, rows["parent"]["run_id"])
            return version, rows["parent"]["run_id"], "complete", snapshot
        self.config.fit = self.config.fit.model_copy(  # type: ignore[union-attr]
            update={"data_fingerprint": snapshot.fingerprint}
        )
        if version is None:
            db.add(self)
        else:
            self.version = version
        return self.version, self._new_run(db, allow, snapshot, rows), "new", snapshot

    def _run_snapshot(self, db: Datalayer, run: Any, allow: bool) -> RunSnapshot:
        """The run's snapshot of its rows: the resumed run's, read from its record; else a
        new one, which a replay first compares with the fit it replays."""
        fit, data = self.config.fit, self.config.data_args
        assert fit is not None  # set by fit() before it registers
        if run is not None and run.info.get("snapshot"):
            return RunSnapshot.from_record(run.info["snapshot"])
        snapshot = take_snapshot(
            db,
            fit.query(),
            eval_fraction=data.eval_fraction,
            version_column=data.version_column,
            cache_size=data.cache_size,
        )
        if snapshot.count == 0:
            raise DataError(f"{fit.query().source} selects 0 rows: nothing to train on")
        if run is not None:  # a run from before snapshots: its resume state is checked
            log.warning("run %s predates key snapshots: took one of its rows now", run.run_id)
            db.metadata.update_run(run.run_id, info={"snapshot": snapshot.to_record()})
        elif (
            fit.data_fingerprint
            and fit.db == db.uri
            and fit.data_fingerprint != snapshot.fingerprint
        ):
            message = (
                f"the rows of {fit.query().source} changed since trainer "
                f"{self.identifier!r} v{self.version} was fitted (data fingerprint "
                f"{fit.data_fingerprint} -> {snapshot.fingerprint})"
            )
            if not allow:
                raise DataChangedError(message + "; pass allow_changed_data=True to train anyway")
            log.warning("%s; training anyway as asked", message)
        return snapshot

    def _fit_spec(
        self,
        X: str | None,
        Y: str | None,
        db: Datalayer,
        select: Query | None,  # noqa: N803
        eval_select: Query | None,
    ) -> FitSpec:
        if X is None and Y is None and select is None:
            if self.config.fit is None:
                raise ConfigError(
                    "fit() needs X=, Y= and select= (only a trainer that was "
                    "fitted before can replay with no arguments)"
                )
            return self.config.fit.model_copy(update={"db": db.uri})
        if X is None or Y is None or select is None:
            raise ConfigError("fit() needs all of X=, Y= and select=")
        if not isinstance(select, Query):
            raise ConfigError(
                f"select= must be a llmtrain query (Table, sql, Collection), "
                f"got {type(select).__name__}"
            )
        if X == Y:
            raise ConfigError(f"X and Y name the same field {X!r}")
        if eval_select is not None and not isinstance(eval_select, Query):
            raise ConfigError("eval_select= must be a llmtrain query")
        return FitSpec(
            X=X,
            Y=Y,
            select=select.to_dict(),
            eval_select=eval_select.to_dict() if eval_select else None,
            db=db.uri,
        )

    def _stored_version(self, db: Datalayer) -> int | None:
        """The stored version with this recipe: the loaded one (a replay of version N stays
        version N), else the newest; None when this recipe is new."""
        from llmtrain.errors import ComponentNotFoundError

        mine = self.to_dict()
        for version in dict.fromkeys([self.version, None]):
            try:
                stored = db.metadata.get_component(self.type_id, self.identifier, version)
            except ComponentNotFoundError:
                continue
            if _same_recipe(stored.payload, mine):
                return stored.version
        return None

    def _run_to_resume(
        self, db: Datalayer, version: int | None, resume: bool | str
    ) -> tuple[Any, bool] | None:
        """(the newest run of this recipe with the wanted checkpoint, whether it completed),
        or None when there is none. A resumable run of another version of the trainer is an
        error: resuming it would train one recipe's run with another's settings."""
        others = []
        for run in reversed(db.metadata.list_runs(self.type_id, self.identifier)):
            checkpoints = db.metadata.list_checkpoints(run.run_id)
            wanted = resume in (True, "latest") or any(
                str(resume) in (c.artifact_id, str(c.step)) for c in checkpoints
            )
            if not (checkpoints and wanted):
                continue
            if version is not None and run.version == version:
                if run.status == "completed":
                    log.info(
                        "run %s of %s v%d is complete: nothing to resume",
                        run.run_id,
                        self.identifier,
                        version,
                    )
                return run, run.status == "completed"
            others.append(run)
        if others:
            this = "a new version" if version is None else f"v{version}"
            newest = others[0]
            raise ConfigError(
                f"fit(resume=): the run to resume ({newest.run_id}) is of trainer "
                f"{self.identifier!r} v{newest.version}, but this recipe is {this}; a resume "
                "continues only a run of the same recipe: drop resume= to start a fresh run, "
                f"or resume with db.load('trainer', {self.identifier!r}, "
                f"version={newest.version}).fit(resume=True)"
            )
        return None

    def _new_run(
        self, db: Datalayer, allow_changed_data: bool, snapshot: RunSnapshot, rows: dict[str, Any]
    ) -> str:
        """A new run of this version. It records this call's ``allow_changed_data``, the
        manifest of its snapshot of the rows and how they were chosen (``rows``: the parent of
        an incremental fit, the keys left out): every rank and every resume reads them there."""
        run_id, fit = uuid.uuid4().hex, self.config.fit
        assert fit is not None  # set by fit() before it registers
        db.metadata.create_run(
            run_id,
            self.type_id,
            self.identifier,
            self.version or 0,
            {
                "config": self.to_dict(),
                "query": fit.select,
                "X": fit.X,
                "Y": fit.Y,
                "data_fingerprint": fit.data_fingerprint,
                "db": db.uri,
                "artifacts": db.artifacts.location,
                "versions": library_versions(),
                "allow_changed_data": allow_changed_data,
                "snapshot": snapshot.to_record(),
                **rows,
            },
        )
        return run_id


def _model_of_run(db: Datalayer, identifier: str, run_id: str) -> Any:
    """The newest model version a run produced."""
    for record in reversed(db.metadata.list_components("model", identifier)):
        if record.payload.get("run_id") == run_id:
            return db.load("model", identifier, record.version)
    raise ConfigError(
        f"run {run_id} of {identifier!r} is complete but its model is no longer stored; "
        "drop resume= to train a fresh run"
    )


def _config(identifier: str, options: dict[str, Any]) -> TrainerConfig:
    """LLMTrainer's keywords -> TrainerConfig, all derived from the schema: an option given
    whole (a section as a model or dict, a scalar), or a flat keyword into its section."""
    qlora = options.pop("qlora", False)
    flat = TrainerConfig.flat_keywords()
    sections = TrainerConfig.sections()
    data: dict[str, Any] = {"identifier": check_identifier(identifier)}
    for name in TrainerConfig.options():
        if name not in options:
            continue
        value = options.pop(name)
        if name in sections and value is not None:
            data[name] = _as_dict(value)
        elif value is not None or _nullable(name):  # None for a required section: defaults
            data[name] = value
    for name, value in options.items():
        if name not in flat:
            raise ConfigError(
                f"unknown option {name!r}: not a keyword of LLMTrainer (see "
                "help(LLMTrainer) for the list)"
            )
        section, field = flat[name]
        if section in data and data[section] is None:
            raise ConfigError(
                f"{name}= configures {section}, but {section}=None "
                + ("asks for full fine-tuning" if section == "lora_args" else "turns it off")
            )
        group = data.setdefault(section, {})
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        if field in group and group[field] != value:
            raise ConfigError(f"{name}= is given twice (also in {section})")
        group[field] = value
    if qlora:
        if "lora_args" in data and data["lora_args"] is None:
            raise ConfigError(
                "qlora=True trains an adapter on a quantised model; it "
                "cannot be combined with lora_args=None"
            )
        data.setdefault("model_args", {}).setdefault("bits", 4)
    if "model_name_or_path" not in data.get("model_args", {}):
        raise ConfigError("LLMTrainer needs model= (a hub id or a local path)")
    return build(TrainerConfig, data, "LLMTrainer")


def _nullable(name: str) -> bool:
    return type(None) in typing.get_args(TrainerConfig.model_fields[name].annotation)


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"expected an arguments model or a dict, got {type(value).__name__}")


def _same_recipe(stored: dict[str, Any], current: dict[str, Any]) -> bool:
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


LLMTrainer.__doc__ = f"{LLMTrainer.__doc__}\n{textwrap.indent(keyword_reference(), '    ')}"
