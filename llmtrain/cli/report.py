"""One run, read back from the metadata store: its summary, its recipe's changes, its plot.

``llmtrain show run NAME`` prints :func:`run_summary` and ``--plot FILE`` writes
:func:`plot_run`; both read only what the run recorded (its record, metrics, checkpoints and
the trainer versions), so they work on any run, finished, failed or still going.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmtrain.config.args import TrainerConfig, build
from llmtrain.console import table
from llmtrain.datalayer import Datalayer
from llmtrain.db.queries import Query
from llmtrain.errors import ConfigError

#: recipe keys that say where and on which rows, not how: shown on their own lines
_NOT_RECIPE = ("fit.data_fingerprint", "fit.db")


def run_summary(db: Datalayer, run: Any) -> list[str]:
    """Where the run trained, its status, duration, steps, tokens, throughput, final and best
    losses, data fingerprint and the recipe's changes from the trainer's previous version,
    one fact a line; then its logged metrics and its checkpoints as tables."""
    info = run.info
    metrics = db.metadata.get_metrics(run.run_id)
    train = [(m.step, m.values) for m in metrics if "loss" in m.values]
    evals = [(m.step, m.values) for m in metrics if "eval_loss" in m.values]
    rate = next((v["tokens_per_s"] for _, v in reversed(train) if "tokens_per_s" in v), None)
    seconds = (run.updated_at - run.created_at).total_seconds()
    lines = [
        f"run        {run.run_id}",
        f"trainer    {run.identifier} v{run.version}",
        f"status     {run.status}" + (f": {run.error}" if run.error else ""),
        f"data       {info.get('X')} -> {info.get('Y')} from {query_text(info.get('query'))}",
        f"database   {info.get('db')}",
        f"steps      {info.get('steps')}, {info.get('tokens')} tokens",
        f"adapter    {info.get('artifact')}",
        f"started    {when(run.created_at)}, updated {when(run.updated_at)}",
        f"duration   {duration(seconds)}"
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
        keys = ("loss", "lr", "tokens_per_s", "eval_loss")
        rows = [(s, *(v.get(k) for k in keys)) for s, v in sorted(by_step.items())]
        lines += ["", table(rows, ["step", "loss", "lr", "tokens/s", "eval loss"])]
    checkpoints = db.metadata.list_checkpoints(run.run_id)
    if checkpoints:
        lines += ["", table([(c.step, c.artifact_id) for c in checkpoints], ["step", "checkpoint"])]
    return lines


def query_text(query: dict[str, Any] | None) -> str:
    """A stored query as one line: ``table docs where lang = :l {'l': 'en'}``."""
    if not query:
        return "-"
    text = Query.from_dict(query).source
    where = query.get("where") or query.get("filter")
    if where:
        text += f" where {where}"
    if query.get("params"):
        text += f" {query['params']}"
    return text


def when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else str(value)


def recipe(payload: dict[str, Any]) -> Any:
    """A stored trainer record read through today's schema (a bad record: ConfigError)."""
    return build(TrainerConfig, payload, "trainer record")


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _final_and_best(points: list[tuple[int, dict[str, float]]], key: str) -> str:
    values = [(step, v[key]) for step, v in points if not math.isnan(v[key])]
    if not values:
        return "-"
    final, best = values[-1], min(values, key=lambda p: p[1])
    return f"final {final[1]:.4f} (step {final[0]}), best {best[1]:.4f} (step {best[0]})"


def recipe_changes(db: Datalayer, run: Any) -> list[str]:
    """The run's trainer version against the previous stored version of that trainer, read
    through today's schema (an option added since shows at its default, not as a change)."""
    versions = {
        r.version: r.payload for r in db.metadata.list_components(run.type_id, run.identifier)
    }
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
    """Every option of a recipe as ``section.field: value``, defaults included (a stored
    record leaves out the options added since 0.1.0 while they hold their defaults)."""
    if not isinstance(value, BaseModel):
        return {prefix: json.loads(json.dumps(value, default=str))}
    flat: dict[str, Any] = {}
    for name in type(value).model_fields:
        flat |= _flat(getattr(value, name), f"{prefix}.{name}" if prefix else name)
    return flat


def _show(value: Any) -> str:
    return "-" if value is None else json.dumps(value) if not isinstance(value, str) else value


def plot_run(db: Datalayer, run: Any, path: str | Path) -> Path:
    """Train loss, eval loss (left axis) and learning rate (right axis) against steps, as a
    PNG at ``path``. Drawn with matplotlib's object API: no pyplot, no global backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError(
            "show run --plot needs matplotlib: pip install 'llmtrain[plot]'"
        ) from None
    metrics = db.metadata.get_metrics(run.run_id)
    train = [(m.step, m.values) for m in metrics if "loss" in m.values]
    evals = [(m.step, m.values["eval_loss"]) for m in metrics if "eval_loss" in m.values]
    if not train and not evals:
        raise ConfigError(f"run {run.run_id} recorded no metrics yet: nothing to plot")
    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    if train:
        ax.plot([s for s, _ in train], [v["loss"] for _, v in train], label="train loss")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    handles, labels = ax.get_legend_handles_labels()
    lr = [(s, v["lr"]) for s, v in train if "lr" in v]
    if lr:
        right = ax.twinx()
        right.plot([s for s, _ in lr], [v for _, v in lr], "--", color="gray", label="lr")
        right.set_ylabel("learning rate")
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(f"{run.identifier} v{run.version}  run {run.run_id[:8]}  ({run.status})")
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, format="png")
    return out
