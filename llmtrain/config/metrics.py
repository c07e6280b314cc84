"""Metrics scoring eval rows' answers: a built-in name or ``package.module:function``, stored
as that path (never a pickle) and imported when the config is built, so a typo fails there."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence

Metric = Callable[[str, str], float]

#: ``package.module:name``: what eval_metrics and fit(callbacks=) import
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
BUILTIN: dict[str, Metric] = {
    "exact_match": lambda prediction, reference: float(prediction.strip() == reference.strip()),
    "contains": lambda prediction, reference: float(reference.strip() in prediction),
}

#: what every evaluation logs (the rewards: a preference objective's), save_best_by may name
SCORED = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins")


def logged_name(entry: str) -> str:
    """``exact_match`` -> ``eval_exact_match``, ``pkg.mod:f1`` -> ``eval_f1``; ``eval_*`` stays."""
    name = entry.rsplit(":", 1)[-1]
    return name if name.startswith("eval_") else f"eval_{name}"


def resolve(entry: str) -> Metric:
    """The function an eval_metrics entry names (else ValueError saying why)."""
    if entry in BUILTIN:
        return BUILTIN[entry]
    if not IMPORT_PATH.match(entry):
        raise ValueError(
            f"{entry!r} is neither {' nor '.join(repr(b) for b in BUILTIN)} nor an import "
            "path 'package.module:function'"
        )
    module, name = entry.split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{entry!r} cannot be imported ({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise ValueError(f"{entry!r} is not callable")
    return fn


def metric_problems(entries: Sequence[str], save_best_by: str | None) -> list[str]:
    """Every bad eval_metrics entry and an unknown save_best_by, each naming its field."""
    problems = []
    for i, entry in enumerate(entries):
        try:
            resolve(entry)
        except ValueError as exc:
            problems.append(f"eval_metrics[{i}]: {exc}")
    names = [logged_name(e) for e in entries]
    if len(set(names)) < len(names):
        problems.append(f"eval_metrics: two entries log as the same name {names}")
    if save_best_by is not None and logged_name(save_best_by) not in {*SCORED, *names}:
        choices = ", ".join([*SCORED, *entries])
        problems.append(f"save_best_by={save_best_by!r} is not scored: choose one of {choices}")
    return problems
