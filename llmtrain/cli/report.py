"""What the ``llmtrain`` commands print, read only from records: any run shows, finished or not."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel

from llmtrain.config.args import TrainerConfig, build
from llmtrain.config.spec import FitSpec
from llmtrain.console import say, table
from llmtrain.datalayer import Datalayer
from llmtrain.db.queries import Conversations, Query
from llmtrain.errors import ComponentNotFoundError, LlmtrainError
from llmtrain.provenance.lineage import chain, forgotten

#: recipe keys that say where and on which rows, not how: shown on their own lines
_NOT_RECIPE = ("fit.data_fingerprint", "fit.db")


def show(db: Datalayer, type_id: str | None, name: str | None) -> None:
    if type_id is None:
        show_all(db)
    elif type_id == "run":
        show_runs(db, name)
    elif name is None:
        show_identifiers(db, type_id)
    elif type_id == "trainer":
        show_trainer(db, name)
    else:
        show_model(db, name)


def report_fit(db: Datalayer, trainer: Any, model: Any) -> None:
    if model is None:  # a launcher's worker processes stored the model
        say(f"done: see `llmtrain show run {trainer.identifier}`")
        return
    run = db.metadata.get_run(model.record.run_id)
    loss = run.info.get("final_loss")
    loss_text = f", final loss {loss:.4f}" if loss is not None else ""
    say(
        f"run {run.run_id}: {run.status}, {run.info.get('steps')} steps{loss_text}",
        f"stored trainer {trainer.identifier} v{run.version} and model "
        f"{model.identifier} v{model.version} (adapter {model.record.adapter})",
        f"database {db.uri}; artifacts in {db.artifacts.location}",
    )


def not_found(db: Datalayer, type_id: str, name: str) -> LlmtrainError:
    known = ", ".join(db.show("trainer" if type_id == "run" else type_id)) or "none"
    return ComponentNotFoundError(f"no {type_id} {name!r} in {db.uri}; known: {known}")


def _versions(records: list[Any]) -> dict[tuple[str, str], str]:
    """``(type, identifier)`` -> its stored versions: ``"0, 1, 2"``."""
    versions: dict[tuple[str, str], list[str]] = {}
    for r in records:
        versions.setdefault((r.type_id, r.identifier), []).append(str(r.version))
    return {key: ", ".join(v) for key, v in versions.items()}


def show_all(db: Datalayer) -> None:
    records = db.metadata.list_components()
    if not records:
        say(f"nothing stored in {db.uri} yet")
        return
    rows = [(*key, v) for key, v in sorted(_versions(records).items())]
    runs = f"{len(db.metadata.list_runs())} run(s): llmtrain show run"
    say(table(rows, ["type", "identifier", "versions"]), runs)


def show_identifiers(db: Datalayer, type_id: str) -> None:
    records = db.metadata.list_components(type_id)
    if not records:
        say(f"no {type_id} stored in {db.uri}")
        return
    versions = _versions(records)
    latest = {r.identifier: r for r in records}  # ordered by version: the newest wins
    rows = []
    for name, record in sorted(latest.items()):
        runs = db.metadata.list_runs("trainer", name)
        last = (runs[-1].status, runs[-1].info.get("final_loss")) if runs else (None, None)
        if type_id == "trainer":
            base = recipe(record.payload).model_args.model_name_or_path
        else:
            base = record.payload["base"]["model_name_or_path"]
        rows.append((name, versions[type_id, name], len(runs), *last, base))
    say(table(rows, ["identifier", "versions", "runs", "last run", "final loss", "base model"]))


def stored_records(db: Datalayer, type_id: str, name: str) -> list[Any]:
    records = db.metadata.list_components(type_id, name)
    if not records:
        raise not_found(db, type_id, name)
    return records


def show_trainer(db: Datalayer, name: str) -> None:
    rows = []
    for r in stored_records(db, "trainer", name):
        config = recipe(r.payload)
        base, data = config.model_args.model_name_or_path, data_text(r.payload)
        rows.append((r.version, when(r.created_at), base, config.method(), data))
    say(table(rows, ["version", "created", "base model", "adapter", "data"]), "")
    show_runs(db, name)


def show_model(db: Datalayer, name: str) -> None:
    records = stored_records(db, "model", name)
    carried = forgotten(db, None)[1]  # rows forgotten since (db.forget): the model carries them
    rows = []
    for r in records:
        p, history = r.payload, r.payload.get("history") or []
        loss = history[-1]["loss"] if history else None
        lost = {k for run, _ in chain(db, p["run_id"]) for k in carried.get(run.run_id, ())}
        row = (r.version, when(r.created_at), p["run_id"], p.get("trainer_version"), loss)
        rows.append((*row, p.get("adapter"), len(lost) or None))
    headers = ["version", "created", "run id", "trainer v", "final loss", "adapter"]
    say(table(rows, [*headers, "forgotten rows"]))


def show_runs(db: Datalayer, name: str | None) -> None:
    """The runs (of trainer ``name``), then in detail run ``name`` (id or prefix) or the newest."""
    runs = db.metadata.list_runs()
    if name is not None:
        by_id = [r for r in runs if r.run_id.startswith(name)] if len(name) >= 6 else []
        if len(by_id) == 1:
            return say(*run_summary(db, by_id[0]))
        runs = [r for r in runs if r.identifier == name]
        if not runs:
            raise not_found(db, "run", name)
    if not runs:
        return say(f"no runs in {db.uri} yet")
    rows = [
        (r.run_id, f"{r.identifier} v{r.version}", r.status, r.info.get("steps"))
        + (r.info.get("final_loss"), when(r.created_at))
        for r in runs
    ]
    say(table(rows, ["run id", "trainer", "status", "steps", "final loss", "started"]))
    if name is not None:
        say("", f"newest run of {name}:", *run_summary(db, runs[-1]))


def report_usage(found: Any) -> None:
    """What :func:`~llmtrain.provenance.lineage.trained_on` found."""
    uses = [(u.run_id, f"{u.trainer} v{u.version}", u.key, u.epoch, u.step) for u in found.uses]
    header = ["run id", "trainer", "key", "epoch", "step"]
    say(table(uses, header) if uses else "no run trained on it")
    if found.checkpoints:
        checkpoints = [(c.run_id, c.step, c.artifact_id) for c in found.checkpoints]
        say(table(checkpoints, ["run id", "step", "checkpoint"]))
    if found.models:
        say("models: " + ", ".join(f"{name} v{version}" for name, version in found.models))
    if found.forgotten:
        shown = ", ".join(str(k) for k in found.forgotten)
        say(f"forgotten (db.forget): {shown}: runs since leave them out")
    if found.underivable:
        say(f"unknown (runs without a key snapshot): {', '.join(found.underivable)}")


def run_summary(db: Datalayer, run: Any) -> list[str]:
    """One fact a line (``llmtrain show run``), then the logged metrics and checkpoints."""
    info = run.info
    metrics = db.metadata.get_metrics(run.run_id)
    train = [(m.step, m.values) for m in metrics if "loss" in m.values]
    evals = [(m.step, m.values) for m in metrics if "eval_loss" in m.values]
    rate = next((v["tokens_per_s"] for _, v in reversed(train) if "tokens_per_s" in v), None)
    lines = [
        f"run        {run.run_id}",
        f"trainer    {run.identifier} v{run.version}",
        f"status     {run.status}" + (f": {run.error}" if run.error else ""),
        f"data       {data_text(info.get('config') or {})}",
        f"database   {info.get('db')}",
        f"steps      {info.get('steps')}, {info.get('tokens')} tokens",
        f"adapter    {info.get('artifact')}",
        f"started    {when(run.created_at)}, updated {when(run.updated_at)}",
        f"duration   {duration((run.updated_at - run.created_at).total_seconds())}"
        + ("" if run.status in ("completed", "failed", "interrupted") else " so far"),
        f"tokens/s   {rate:.0f} (training)" if rate is not None else "tokens/s   -",
        f"loss       {_final_and_best(train, 'loss')}",
    ]
    if evals:
        lines.append(f"eval loss  {_final_and_best(evals, 'eval_loss')}")
    lines.append(f"data fingerprint  {info.get('data_fingerprint') or '-'}")
    lines += recipe_changes(db, run)
    ray = info.get("ray")
    if isinstance(ray, dict):
        lines.append(
            f"ray        {ray.get('name')}: {ray.get('status')}, {ray.get('num_workers')} "
            f"worker(s), storage {ray.get('storage')}, checkpoints "
            f"{', '.join(ray.get('checkpoints') or []) or '-'}"
        )
    by_step: dict[int, dict[str, float]] = {}
    for m in metrics:  # an evaluation off the logging steps gets its own row
        by_step.setdefault(m.step, {}).update(m.values)
    if by_step:
        keys = ["loss", "lr", "tokens_per_s", "eval_loss"]  # then the objective's, evaluation's
        keys += sorted({k for v in by_step.values() for k in v} - {*keys, "tokens", "grad_norm"})
        rows = [(s, *(v.get(k) for k in keys)) for s, v in sorted(by_step.items())]
        lines += ["", table(rows, ["step", *(k.replace("_per_s", "/s") for k in keys)])]
    checkpoints = db.metadata.list_checkpoints(run.run_id)
    if checkpoints:
        lines += ["", table([(c.step, c.artifact_id) for c in checkpoints], ["step", "checkpoint"])]
    return lines


def data_text(config: dict[str, Any]) -> str:
    """What a trainer's (or run's) recorded fit reads, each source in its shape."""
    if not (fit := config.get("fit")):
        return "-"
    spec, chat = FitSpec.model_validate(fit), (config.get("data_args") or {}).get("chat_template")
    shown = []
    for part in spec.parts():
        x, *y = part.fields_or(spec.fields)  # y: the answer, the pair's or the answer and label
        kind = "conversations" if chat or isinstance(part.select, Conversations) else "documents"
        what = f"{x} -> {' over '.join(y) if spec.pairs else y[0]}" if y else f"{x} ({kind})"
        liked = f" (liked: {spec.label})" if spec.label else ""
        shown.append(f"{what}{liked} from {query_text(part.select.to_dict())}")
    return "; ".join(shown)


def query_text(query: dict[str, Any] | None) -> str:
    """A stored query as one line: ``table docs where lang = :l {'l': 'en'}``."""
    if not query:
        return "-"
    text = Query.from_dict(query).source
    where = query.get("where") or query.get("filter")
    text += f" where {where}" if where else ""
    return text + (f" {query['params']}" if query.get("params") else "")


def when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else str(value)


def recipe(payload: dict[str, Any]) -> Any:
    """A stored trainer record read through today's schema."""
    return build(TrainerConfig, payload, "trainer record")


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s"


def _final_and_best(points: list[tuple[int, dict[str, float]]], key: str) -> str:
    values = [(step, v[key]) for step, v in points if not math.isnan(v[key])]
    if not values:
        return "-"
    final, best = values[-1], min(values, key=lambda p: p[1])
    return f"final {final[1]:.4f} (step {final[0]}), best {best[1]:.4f} (step {best[0]})"


def recipe_changes(db: Datalayer, run: Any) -> list[str]:
    """Against the previous version, both read through today's schema (a new option: no change)."""
    records = db.metadata.list_components(run.type_id, run.identifier)
    versions = {r.version: r.payload for r in records}
    earlier = [v for v in versions if v < run.version]
    if run.version not in versions:
        return [f"recipe     v{run.version} is no longer stored"]
    if not earlier:
        return [f"recipe     v{run.version} is the first version of {run.identifier}"]
    previous = max(earlier)
    before, after = _flat(recipe(versions[previous])), _flat(recipe(versions[run.version]))
    changed = [
        (key, before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys())
        if key not in _NOT_RECIPE and before.get(key) != after.get(key)
    ]
    if not changed:
        return [f"recipe     same as v{previous} (only the rows or the database differ)"]
    lines = [f"recipe     changes from v{previous}:"]
    lines += [f"  {key}: {_show(old)} -> {_show(new)}" for key, old, new in changed]
    return lines


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every option of a recipe as ``section.field: value``, defaults included."""
    if not isinstance(value, BaseModel):
        return {prefix: json.loads(json.dumps(value, default=str))}
    flat: dict[str, Any] = {}
    for name in type(value).model_fields:
        flat |= _flat(getattr(value, name), f"{prefix}.{name}" if prefix else name)
    return flat


def _show(value: Any) -> str:
    return "-" if value is None else json.dumps(value) if not isinstance(value, str) else value
