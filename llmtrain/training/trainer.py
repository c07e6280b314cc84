"""LLMTrainer: the component users create, fit, store and replay."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from pydantic import ValidationError

from llmtrain.components import check_identifier, register_component
from llmtrain.errors import ConfigError, DataChangedError
from llmtrain.formatting import PromptTemplate
from llmtrain.queries import Query
from llmtrain.training.args import (
    DataArguments,
    DeepspeedConfig,
    FSDPConfig,
    LoraArguments,
    ModelArguments,
    TrainingArguments,
    build,
    describe,
    flat_keyword_target,
)
from llmtrain.training.spec import FitSpec, LauncherConfig, TrainerConfig
from llmtrain.versions import library_versions

log = logging.getLogger("llmtrain.training")
_DEFAULT = object()
_GROUPS = {"model_args": ModelArguments, "lora_args": LoraArguments,
           "training_args": TrainingArguments, "data_args": DataArguments}


@register_component
class LLMTrainer:
    """Fine-tunes a causal LM with LoRA, QLoRA (``bits=4``) or DoRA on database rows.

    ``LLMTrainer("sft-v1", model="...", bits=4, qlora=True, prompt_template="...{X}...{Y}")``
    or the granular form with ``model_args=``, ``lora_args=``, ``training_args=`` and
    ``data_args=``. Flat keywords map onto those models; ``lora_args=None`` fine-tunes all
    weights.
    """

    type_id = "trainer"

    #: the last fit's scan of its selection, which its run reuses instead of scanning again
    data_scan: Any = None

    def __init__(self, identifier: str, *, model: str | None = None,
                 prompt_template: str | None = None,
                 model_args: ModelArguments | dict[str, Any] | None = None,
                 lora_args: LoraArguments | dict[str, Any] | None = _DEFAULT,  # type: ignore[assignment]
                 training_args: TrainingArguments | dict[str, Any] | None = None,
                 data_args: DataArguments | dict[str, Any] | None = None,
                 deepspeed_config: DeepspeedConfig | dict[str, Any] | None = None,
                 fsdp_config: FSDPConfig | dict[str, Any] | None = None,
                 launcher: LauncherConfig | dict[str, Any] | None = None,
                 qlora: bool = False, **flat: Any) -> None:
        groups: dict[str, dict[str, Any]] = {
            "model_args": _as_dict(model_args), "training_args": _as_dict(training_args),
            "data_args": _as_dict(data_args),
            "lora_args": {} if lora_args is _DEFAULT else _as_dict(lora_args)}
        full_finetune = lora_args is None
        if model is not None:
            flat["model"] = os.fspath(model) if isinstance(model, os.PathLike) else model
        for name, value in flat.items():
            group, field = flat_keyword_target(name)
            if group == "lora_args" and full_finetune:
                raise ConfigError(f"{name}= configures the adapter, but lora_args=None asks for "
                                  "full fine-tuning")
            if field in groups[group] and groups[group][field] != value:
                raise ConfigError(f"{name}= is given twice (also in {group})")
            groups[group][field] = value
        if qlora:
            if full_finetune:
                raise ConfigError("qlora=True trains an adapter on a quantised model; it "
                                  "cannot be combined with lora_args=None")
            groups["model_args"].setdefault("bits", 4)
        if "model_name_or_path" not in groups["model_args"]:
            raise ConfigError("LLMTrainer needs model= (a hub id or a local path)")
        try:
            config = TrainerConfig(
                identifier=check_identifier(identifier), prompt_template=prompt_template,
                model_args=groups["model_args"],
                lora_args=None if full_finetune else groups["lora_args"],
                training_args=groups["training_args"], data_args=groups["data_args"],
                # an empty dict asks for the defaults: only None means "not this strategy"
                deepspeed_config=None if deepspeed_config is None else _as_dict(deepspeed_config),
                fsdp_config=None if fsdp_config is None else _as_dict(fsdp_config),
                launcher=None if launcher is None else _as_dict(launcher))
        except ValidationError as exc:
            raise ConfigError(describe("LLMTrainer", exc)) from None
        self.config = _checked(config)
        self.version: int | None = None
        self.db: Any = None

    # -- component protocol ----------------------------------------------------------------
    @property
    def identifier(self) -> str:
        return self.config.identifier

    def to_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLMTrainer:
        config = build(TrainerConfig, data)  # type: ignore[arg-type]
        trainer = cls.__new__(cls)
        trainer.config, trainer.version, trainer.db = _checked(config), None, None
        return trainer

    def _attach(self, db: Any) -> None:
        self.db = db

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LLMTrainer) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        model = self.config.model_args.model_name_or_path
        return f"LLMTrainer({self.identifier!r}, model={model!r}, version={self.version})"

    # -- training --------------------------------------------------------------------------
    def fit(self, X: str | None = None, Y: str | None = None, db: Any = None,  # noqa: N803
            select: Query | None = None, *, eval_select: Query | None = None,
            resume: bool | str = False, merge: bool = False,
            allow_changed_data: bool | None = None) -> Any:
        """Train on ``select``'s rows (``X`` -> prompt, ``Y`` -> response) and store the result.

        With no arguments, a trainer loaded by ``db.load`` replays its last fit. Returns the
        trained model component (``db.load("model", identifier)`` gives it back later).
        """
        from llmtrain.training.launch import execute, once_per_job

        db = db if db is not None else self.db
        if db is None:
            raise ConfigError("fit() needs db=: the database to read rows from and store into")
        spec = self._fit_spec(X, Y, db, select, eval_select)
        replaying = X is None and select is None
        if allow_changed_data is not None:
            self.config.data_args.allow_changed_data = allow_changed_data
        # the run's one scan of the selection: rank 0's in a launched job, shared with the run
        self.data_scan = once_per_job(_data_scan, db, spec, self.config.data_args)
        fingerprint = self.data_scan.fingerprint
        if replaying and spec.data_fingerprint and spec.db == db.uri \
                and spec.data_fingerprint != fingerprint and not resume:
            message = (f"the rows of {spec.query().source} changed since trainer "
                       f"{self.identifier!r} v{self.version} was fitted (data fingerprint "
                       f"{spec.data_fingerprint} -> {fingerprint})")
            if not self.config.data_args.allow_changed_data:
                raise DataChangedError(message + "; pass allow_changed_data=True to train anyway")
            log.warning("%s; training anyway as asked", message)
        self.config.fit = spec.model_copy(update={"data_fingerprint": fingerprint})
        self.db = db
        # under torchrun/deepspeed every rank runs fit(): rank 0 alone stores and opens the run
        self.version, run_id = once_per_job(self._register, db, resume)
        return execute(self, db, run_id, resume=resume, merge=merge)

    def _register(self, db: Any, resume: bool | str) -> tuple[int | None, str]:
        self._store(db)
        return self.version, self._run_for(db, resume)

    def _fit_spec(self, X: str | None, Y: str | None, db: Any, select: Query | None,  # noqa: N803
                  eval_select: Query | None) -> FitSpec:
        if X is None and Y is None and select is None:
            if self.config.fit is None:
                raise ConfigError("fit() needs X=, Y= and select= (only a trainer that was "
                                  "fitted before can replay with no arguments)")
            return self.config.fit.model_copy(update={"db": db.uri})
        if X is None or Y is None or select is None:
            raise ConfigError("fit() needs all of X=, Y= and select=")
        if not isinstance(select, Query):
            raise ConfigError(f"select= must be a llmtrain query (Table, sql, Collection), "
                              f"got {type(select).__name__}")
        if X == Y:
            raise ConfigError(f"X and Y name the same field {X!r}")
        if eval_select is not None and not isinstance(eval_select, Query):
            raise ConfigError("eval_select= must be a llmtrain query")
        return FitSpec(X=X, Y=Y, select=select.to_dict(),
                       eval_select=eval_select.to_dict() if eval_select else None, db=db.uri)

    def _store(self, db: Any) -> None:
        """Add a new version only when the configuration differs from the newest one."""
        from llmtrain.errors import ComponentNotFoundError

        try:
            newest = db.metadata.get_component(self.type_id, self.identifier)
        except ComponentNotFoundError:
            newest = None
        if newest is not None and _same_recipe(newest.payload, self.to_dict()):
            self.version = newest.version
        else:
            db.add(self)

    def _run_for(self, db: Any, resume: bool | str) -> str:
        """A new run, or for ``resume`` the newest run of this trainer that has checkpoints."""
        if resume:
            for run in reversed(db.metadata.list_runs(self.type_id, self.identifier)):
                checkpoints = db.metadata.list_checkpoints(run.run_id)
                wanted = resume in (True, "latest") or any(
                    str(resume) in (c.artifact_id, str(c.step)) for c in checkpoints)
                if checkpoints and wanted:
                    db.metadata.update_run(run.run_id, status="running", error=None)
                    return run.run_id
            log.info("nothing to resume for %s: starting a new run", self.identifier)
        run_id = uuid.uuid4().hex
        db.metadata.create_run(run_id, self.type_id, self.identifier, self.version or 0, {
            "config": self.to_dict(), "query": self.config.fit.select,
            "X": self.config.fit.X, "Y": self.config.fit.Y,
            "data_fingerprint": self.config.fit.data_fingerprint, "db": db.uri,
            "versions": library_versions()})
        return run_id


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_unset=False)
    if isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"expected an arguments model or a dict, got {type(value).__name__}")


def _checked(config: TrainerConfig) -> TrainerConfig:
    """Cross-field rules, before any data is read."""
    data = config.data_args
    if data.chat_template:
        if config.prompt_template is not None:
            raise ConfigError("give prompt_template= or data_args.chat_template=True, not both")
    elif config.prompt_template is None:
        raise ConfigError("LLMTrainer needs prompt_template= (with {X} and {Y}) or "
                          "chat_template=True")
    else:
        PromptTemplate(config.prompt_template)
    if config.model_args.bits and config.lora_args is None:
        raise ConfigError(f"bits={config.model_args.bits} quantises the frozen base model, which "
                          "only an adapter can train: keep lora_args (QLoRA) or drop bits")
    if config.deepspeed_config and config.fsdp_config:
        raise ConfigError("choose deepspeed_config or fsdp_config, not both")
    return config


def _same_recipe(stored: dict[str, Any], current: dict[str, Any]) -> bool:
    strip = lambda d: {**d, "fit": {**(d.get("fit") or {}), "data_fingerprint": None}}  # noqa: E731
    return strip(stored) == strip(current)


def _data_scan(db: Any, spec: FitSpec, data: DataArguments) -> Any:
    from llmtrain.datasets import scan_selection

    return scan_selection(db.backend, spec.query(), data.cache_size, data.eval_fraction)
