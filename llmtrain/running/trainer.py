"""LLMTrainer: the component users create, fit, store and replay."""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Sequence
from typing import Any, ClassVar, get_args

from llmtrain.config.args import TrainerConfig, build, keyword_reference
from llmtrain.config.spec import FitSpec, default_x
from llmtrain.console import quieted
from llmtrain.datalayer import Datalayer, require_datalayer
from llmtrain.db.queries import Mix, Query, sql_reward
from llmtrain.errors import ConfigError
from llmtrain.integrations.trackers import check_trackers
from llmtrain.placement import Placement
from llmtrain.stores.components import check_identifier, register_component
from llmtrain.training.callbacks import Callback, callback_path
from llmtrain.training.model import TrainedModel


@register_component
class LLMTrainer:
    """Fine-tunes a causal LM with LoRA, QLoRA (``bits=4``) or DoRA on database rows.

    ``LLMTrainer("sft-v1", model="...", bits=4, qlora=True, prompt_template="...{X}...{Y}")``,
    or sections ``model_args=``, ``lora_args=``, ``training_args=``, ``data_args=`` (models or
    dicts) that a flat keyword sets one field of; a field given twice with different values, or
    a keyword naming no field, is an error. ``lora_args=None`` fine-tunes all weights. Bad
    values and combinations are refused here, before any data is read.
    """

    type_id: ClassVar[str] = "trainer"

    def __init__(self, identifier: str, **options: Any) -> None:
        self.config: TrainerConfig = _config(identifier, options)
        check_trackers(self.config.training_args.report_to)
        self.version: int | None = None
        self.db: Datalayer | None = None

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

    def fit(
        self,
        X: str | None = None,
        Y: str | None = None,
        db: Datalayer | None = None,  # noqa: N803
        select: Query | None = None,
        *,
        chosen: str | None = None,
        rejected: str | None = None,
        label: str | None = None,
        reward: Any = None,
        eval_select: Query | None = None,
        resume: bool | str = False,
        allow_changed_data: bool | None = None,
        incremental: bool = False,
        allow_forgotten_parent: bool = False,
        callbacks: Sequence[Callback | str] = (),
        verbose: bool = False,
    ) -> TrainedModel | None:
        """Train on ``select``'s rows (``X`` -> prompt, ``Y`` -> response) and store the result.

        No arguments: a trainer from ``db.load`` replays its last fit. Returns the model (None on
        the other ranks of a job whose every rank calls fit()). ``resume=`` (``True``, a step or a
        checkpoint's artifact id) continues the newest run of this trainer version (another
        version's is refused; a completed one returns its model). ``allow_changed_data=True``:
        replay though the rows changed (this call only, recorded; default from ``data_args``).
        ``chosen=``, ``rejected=``: the preferred and the other answer to ``X``; ``label=``: the
        field saying whether the user liked ``Y``; ``reward=``: what scores sampled answers,
        ``lt.sql_reward(...)``, a function ``"module:name"``, or a list (each objective says
        which fields it takes: ``llmtrain.objectives``).
        ``incremental=True`` trains only rows no completed run of this trainer trained (new keys;
        changed versions too with ``data_args.version_column``) from the newest model's adapter,
        its parent, which needs the same base and adapter shape and no rows forgotten since
        (``allow_forgotten_parent=True``: continue anyway, recorded); nothing new returns it.
        ``callbacks``: Callback objects, or ``"module:Name"`` paths every process builds (all a
        launcher's workers take; recorded). Third-party output stays hidden unless ``verbose=True``.
        """
        with quieted(not verbose):
            from llmtrain.running.executors import execute, execution
            from llmtrain.running.local import model_of_run, once_per_job
            from llmtrain.running.register import register
            from llmtrain.training.plan import Done

            db = db if db is not None else self.db
            if db is None:
                raise ConfigError("fit() needs db=: the database to read rows from and store into")
            require_datalayer(db, "fit(db=)")
            if allow_changed_data is None:
                allow_changed_data = self.config.data_args.allow_changed_data
            flags = {
                "allow_changed_data": allow_changed_data,
                "incremental": incremental,
                "allow_forgotten_parent": allow_forgotten_parent,
            }
            for name, value in flags.items():
                if not isinstance(value, bool):
                    raise ConfigError(f"fit({name}=) must be True or False, got {value!r}")
            spec = self._fit_spec(X, Y, db, select, eval_select, chosen, rejected, label, reward)
            data = {**self.config.model_dump(), "fit": spec.model_dump()}
            config = build(TrainerConfig, data, "LLMTrainer")  # the rules that need the fit's data
            placement = Placement.from_environment()  # resolved once for the whole fit
            specs = tuple(callback_path(c) for c in callbacks if isinstance(c, str))
            objects = [c for c in callbacks if not isinstance(c, str)]
            if objects and config.launcher is not None and not placement.launched:
                raise ConfigError(
                    "fit(callbacks=) with a launcher takes import paths 'module:Name' (each worker "
                    f"builds its own), not objects: {objects!r}"
                )
            with execution(config, placement):
                # under torchrun all ranks run fit(): rank 0 alone registers, the rest get its plan
                plan = once_per_job(
                    placement,
                    register,
                    db,
                    config,
                    self.version,
                    resume=resume,
                    callbacks=specs,
                    **flags,
                )
                if isinstance(plan, Done):
                    return model_of_run(db, plan.run_id)
                self.config, self.version, self.db = plan.config, plan.version, db
                return execute(plan, db, placement, callbacks=objects)

    def _fit_spec(
        self,
        X: str | None,
        Y: str | None,
        db: Datalayer,
        select: Query | None,  # noqa: N803
        eval_select: Query | None,
        chosen: str | None = None,
        rejected: str | None = None,
        label: str | None = None,
        reward: Any = None,
    ) -> FitSpec:
        if X is None and Y is None and select is None and not (chosen or rejected or label):
            if self.config.fit is None:
                raise ConfigError(
                    "fit() needs X=, Y= and select= (only a trainer that was "
                    "fitted before can replay with no arguments)"
                )
            return self.config.fit.model_copy(update={"db": db.uri})
        if X is None and isinstance(select, Query):
            X = default_x(select.to_dict())
        if X is None and isinstance(select, Mix):
            raise ConfigError(
                "fit(select=lt.mix(...)) needs X= (and Y=) for its sources without "
                ".fields(X=..., Y=...)"
            )
        if X is None or select is None:
            raise ConfigError("fit() needs X= and select= (and Y=, unless the rows are documents)")
        if not isinstance(select, Query):
            raise ConfigError(
                f"select= must be a llmtrain query (Table, sql, Collection), "
                f"got {type(select).__name__}"
            )
        named = [f for f in (X, Y, chosen, rejected, label) if f]
        if len(set(named)) < len(named):
            raise ConfigError(
                f"fit(): X, Y, chosen, rejected and label name the same field twice: {named}"
            )
        if eval_select is not None and not isinstance(eval_select, Query):
            raise ConfigError("eval_select= must be a llmtrain query")
        if isinstance(eval_select, Mix):
            raise ConfigError(
                "eval_select= takes one source, not lt.mix(...): evaluate a mixture on its "
                "held-out rows (data_args.eval_fraction)"
            )
        return FitSpec(
            X=X,
            Y=Y,
            chosen=chosen,
            rejected=rejected,
            label=label,
            reward=_rewards(reward),
            select=select.to_dict(),
            eval_select=eval_select.to_dict() if eval_select else None,
            db=db.uri,
        )


def _rewards(reward: Any) -> list[dict[str, Any]] | None:
    """fit(reward=) as recorded: each an lt.sql_reward or an import path ``"module:name"``."""
    if reward is None:
        return None
    out = []
    for one in reward if isinstance(reward, (list, tuple)) else [reward]:
        one = one.get("function", one) if isinstance(one, dict) else one  # as recorded, YAML
        if isinstance(one, str) and re.fullmatch(r"[\w.]+:[\w.]+", one):
            out.append({"function": one})
        elif isinstance(one, dict) and set(one) - {"timeout_s"} == {"sql"}:
            out.append(sql_reward(one["sql"], **{k: v for k, v in one.items() if k != "sql"}))
        else:
            raise ConfigError(
                f"fit(reward=) takes lt.sql_reward(...) or a function 'module:name', got {one!r}"
            )
    return out


def _config(identifier: str, options: dict[str, Any]) -> TrainerConfig:
    """LLMTrainer's keywords -> TrainerConfig, all derived from the schema: an option given
    whole (a section as a model or dict, a scalar), or a flat keyword into its section."""
    qlora = options.pop("qlora", False)
    flat, sections = TrainerConfig.flat_keywords(), TrainerConfig.sections()
    data: dict[str, Any] = {"identifier": check_identifier(identifier)}
    for name in [name for name in TrainerConfig.options() if name in options]:
        value = options.pop(name)
        nullable = type(None) in get_args(TrainerConfig.model_fields[name].annotation)
        if name in sections and value is not None:
            data[name] = _as_dict(value)
        elif value is not None or nullable:  # None for a required section: defaults
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


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"expected an arguments model or a dict, got {type(value).__name__}")


LLMTrainer.__doc__ = f"{LLMTrainer.__doc__}\n{textwrap.indent(keyword_reference(), '    ')}"
