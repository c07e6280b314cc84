"""Training objectives by name, as strategies are: each module owns the fit() fields it takes,
its rules, its rows' check, its collate, its reference and its loss. A new objective is one
module and one line in :data:`OBJECTIVES`."""

from __future__ import annotations

from typing import Any

from llmtrain.objectives.base import Objective
from llmtrain.objectives.dpo import DPO
from llmtrain.objectives.grpo import GRPO
from llmtrain.objectives.kto import KTO
from llmtrain.objectives.orpo import ORPO
from llmtrain.objectives.sft import SFT
from llmtrain.objectives.simpo import SimPO

OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (SFT(), DPO(), KTO(), ORPO(), SimPO(), GRPO())
}


#: every objective's own settings, the fields of objective_args besides name, beta and loss_type
SETTINGS = tuple(o.settings for o in OBJECTIVES.values() if o.settings is not None)


def as_stored(args: dict[str, Any]) -> dict[str, Any]:
    """objective_args, records of an earlier schema too: its loss_type default, "sigmoid" for
    every objective, is the objective's own default now (None)."""
    objective = OBJECTIVES.get(args.get("objective", "sft"))
    default = objective.loss_types[:1] if objective else ()
    if args.get("loss_type") == "sigmoid" and list(default) in ([], ["sigmoid"]):
        return {**args, "loss_type": None}
    return args


def objective_of(config: Any) -> Objective:
    """The objective a TrainerConfig trains."""
    return OBJECTIVES[config.objective_args.objective]


def objective_problems(config: Any) -> list[str]:
    """The fit's fields against its objective's (one that takes them named), then its rules."""
    chosen, fit, problems = objective_of(config), config.fit, []
    if fit is not None and not chosen.takes(fit.roles):
        extra = [r for r in fit.roles if r not in SFT.roles]  # what makes rows more than text
        fits = [o for o in OBJECTIVES.values() if extra and o.takes(fit.roles)]
        if fits:
            quoted = [repr(o.name) for o in fits]
            names = " or ".join(filter(None, [", ".join(quoted[:-1]), quoted[-1]]))
            trains = fits[0].trains
            problems.append(
                f"fit({', '.join(f'{r}=' for r in extra)}) trains {trains}: set objective={names}"
            )
        missing = [r for r in chosen.roles if r not in fit.roles and r not in chosen.optional]
        if missing:
            wanted = ", ".join(f"{r}=" for r in chosen.roles)
            problems.append(
                f"objective={chosen.name!r} trains fit({wanted}): "
                f"{' and '.join(f'{r}=' for r in missing)} missing"
            )
    args, own = config.objective_args, chosen.settings.model_fields if chosen.settings else {}
    for other in OBJECTIVES.values():
        for name, field in other.settings.model_fields.items() if other.settings else ():
            if name not in own and getattr(args, name) != field.default:
                problems.append(
                    f"{name}={getattr(args, name)!r} is a setting of objective={other.name!r}; "
                    f"objective={chosen.name!r} does not take it"
                )
    if args.loss_type is not None and args.loss_type not in chosen.loss_types:
        takes = ", ".join(map(repr, chosen.loss_types)) or "none"
        problems.append(f"loss_type={args.loss_type!r}: objective={chosen.name!r} takes {takes}")
    return problems + chosen.problems(config)


__all__ = ["OBJECTIVES", "SETTINGS", "Objective", "as_stored", "objective_of", "objective_problems"]
